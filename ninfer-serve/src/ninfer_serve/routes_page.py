"""The chat page: static files shipped inside this package (``ninfer_serve/static``), served at ``/`` and
``/static/NAME``.

Only the files listed in :data:`PAGE_FILES` are served, each by its exact name: no directory listing, no path
walking, nothing read from outside the package. :func:`page_paths` gives the exact URL paths of the page, which
the API-key gate leaves open (the page holds no data; every API call it makes carries the key). The page loads
nothing from outside the server. With ``ServeConfig.ui`` off the routes are not registered, so ``/`` is a 404.
"""

from __future__ import annotations

from importlib import resources

from litestar import Request, Response, route
from litestar.exceptions import NotFoundException

from ninfer_serve.routes_system import GET_AND_HEAD

# name -> content type; every shipped page file, and nothing else, is served.
PAGE_FILES = {
    "index.html": "text/html; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
}
# The page's own files must not be framed by other sites nor run scripts from anywhere but this server.
_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "cache-control": "no-cache",
}


def page_paths() -> frozenset[str]:
    """The exact URL paths the page is served on."""
    return frozenset({"/", *(f"/static/{name}" for name in PAGE_FILES)})


def read_page_file(name: str) -> bytes:
    return resources.files("ninfer_serve").joinpath("static", name).read_bytes()


def _file(name: str) -> Response:
    return Response(read_page_file(name), media_type=PAGE_FILES[name], headers=_HEADERS)


@route("/", http_method=GET_AND_HEAD)
async def index(request: Request) -> Response:
    return _file("index.html")


@route("/static/{name:str}", http_method=GET_AND_HEAD)
async def static_file(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in PAGE_FILES:
        raise NotFoundException(f"no page file {name!r}")
    return _file(name)


PAGE_ROUTES = [index, static_file]
