"""Frontend resources: which files of the source folder become raw-byte resources of which component.

Roles are the upstream file names. The ``text`` component gets ``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja`` and ``generation_config.json``; a planned
``vision`` component gets ``preprocessor_config.json``, ``video_preprocessor_config.json`` and
``processor_config.json`` (the image and video preprocessing settings the frontend reads with media).
Invariants of :func:`collect_resources`:

- a resource is present only when its source exists (absent files are simply not stored);
- resource bytes are the source file's bytes, except ``chat_template.jinja`` when the folder has
  none: then it is the ``chat_template`` string of ``chat_template.json`` or, failing that, of
  ``tokenizer_config.json``, UTF-8 encoded (``derived_from`` names the file);
- object ids are ``resource/<component>/<role>`` and every resource has at least one byte;
- the ``text`` resources load the way the runtime loads them (:mod:`ninfer.conversion.resource_checks`):
  a broken one is a :class:`~ninfer.conversion.errors.SourceError` naming the file, before anything is written.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from ninfer.conversion.errors import SourceError
from ninfer.conversion.resource_checks import check_text_resources

TEXT_ROLES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
VISION_ROLES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
CHAT_TEMPLATE = "chat_template.jinja"
# Where a chat template string may live when there is no chat_template.jinja, in order of preference.
_TEMPLATE_HOLDERS = ("chat_template.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Resource:
    """One resource object: copied from ``path``, or ``data`` derived from the ``derived_from`` file."""

    component: str
    role: str
    nbytes: int
    path: Path | None = None
    data: bytes | None = None
    derived_from: str | None = None

    @property
    def object_id(self) -> str:
        return f"resource/{self.component}/{self.role}"

    @property
    def source_name(self) -> str:
        """The source file the bytes come from."""
        return self.path.name if self.path is not None else str(self.derived_from)

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        assert self.path is not None
        data = self.path.read_bytes()
        if len(data) != self.nbytes:
            raise SourceError(f"resource file {str(self.path)!r} changed size during the conversion")
        return data


def collect_resources(folder: Path, components: Collection[str]) -> tuple[Resource, ...]:
    """The resources of ``folder`` for the planned ``components`` (``text`` always among them)."""
    found: list[Resource] = []
    for role in TEXT_ROLES:
        res = _file_resource(folder, "text", role)
        if res is None and role == CHAT_TEMPLATE:
            res = _derived_chat_template(folder)
        if res is not None:
            found.append(res)
    if "vision" in components:
        for role in VISION_ROLES:
            res = _file_resource(folder, "vision", role)
            if res is not None:
                found.append(res)
    check_text_resources(found, folder)
    return tuple(found)


def _file_resource(folder: Path, component: str, role: str) -> Resource | None:
    path = folder / role
    if not path.is_file():
        return None
    size = path.stat().st_size
    if size == 0:
        raise SourceError(f"resource file {str(path)!r} is empty")
    return Resource(component, role, size, path=path)


def _derived_chat_template(folder: Path) -> Resource | None:
    for holder in _TEMPLATE_HOLDERS:
        path = folder / holder
        if not path.is_file():
            continue
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SourceError(f"{str(path)!r} is not valid JSON: {exc}") from None
        template = content.get("chat_template") if isinstance(content, dict) else None
        # A list of named templates stays inside tokenizer_config.json, which is stored as-is.
        if isinstance(template, str) and template:
            data = template.encode("utf-8")
            return Resource("text", CHAT_TEMPLATE, len(data), data=data, derived_from=holder)
    return None
