"""The chat page in a real headless browser (Chromium through Selenium) against ``ninfer serve`` in a subprocess
(the embedded default model on the CPU, with an API key): the key prompt on a 401 and then a reply streamed into
the page, the stop button cancelling a long generation on the server, a server error shown in the page, and the
markdown renderer escaping what the model writes.

Skipped when Chromium, its driver or Selenium is missing. Every wait is on a DOM condition or a metric with a
generous hang guard (HANG_GUARD_S), never a speed requirement. With thinking on, the default model thinks until
max_tokens, which makes the long generation the stop test needs; with thinking off it answers in a few tokens."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time

import httpx
import pytest
from serve_helpers import start_server_process

KEY = "page-browser-key"
MODEL = "page-model"
HANG_GUARD_S = 300
MAX_CONTEXT = 4096


def _browser_paths() -> tuple[str, str]:
    binary = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no Chromium or chromedriver on PATH: apt-get install chromium chromium-driver")
    return binary, driver


@pytest.fixture(scope="module")
def browser():
    binary, driver_path = _browser_paths()
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed: pip install selenium")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    drv = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    drv.set_script_timeout(60)
    yield drv
    drv.quit()


@pytest.fixture(scope="module")
def server(artifact):
    base, proc = start_server_process(
        artifact, "--device", "cpu", "--dtype", "bfloat16", "--max-concurrency", "2", "--max-context", str(MAX_CONTEXT),
        "--model-id", MODEL, "--api-key", KEY, "--log-level", "warning", "--shutdown-timeout", "30",
        timeout=HANG_GUARD_S)
    yield base
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def _wait(drv, condition, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(drv, HANG_GUARD_S, poll_frequency=0.05).until(lambda d: condition(d), message=what)


def _js(drv, script: str, *args):
    return drv.execute_script(script, *args)


def _open_with_key(drv, base: str) -> None:
    drv.get(base + "/")
    _js(drv, "sessionStorage.setItem('ninfer-api-key', arguments[0])", KEY)
    drv.get(base + "/")
    _wait(drv, lambda d: _js(d, "return document.getElementById('model').textContent") == MODEL, "model name shown")


def _settings(drv, *, max_tokens: int, thinking: bool) -> None:
    _js(drv, "document.getElementById('settings').open = true;"
             "document.getElementById('max-tokens').value = String(arguments[0]);"
             "document.getElementById('thinking').checked = arguments[1];", max_tokens, thinking)


def _send(drv, text: str) -> None:
    from selenium.webdriver.common.by import By

    box = drv.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    drv.find_element(By.ID, "send").click()


def _last_state(drv) -> str | None:
    return _js(drv, "const m = [...document.querySelectorAll('.message.assistant')].pop(); "
                    "return m ? m.dataset.state : null")


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not exposed")


def _metrics(base: str) -> str:
    return httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=HANG_GUARD_S).text


def test_key_prompt_then_a_streamed_reply(browser, server):
    browser.get(server + "/")
    _js(browser, "sessionStorage.clear()")
    browser.get(server + "/")
    # The page loads without the key; its first API call gets 401 and the page asks for the key.
    _wait(browser, lambda d: _js(d, "return !document.getElementById('key-form').hidden"), "key prompt shown")
    assert "missing API key" in _js(browser, "return document.getElementById('error').textContent")
    _js(browser, "document.getElementById('api-key').value = arguments[0];"
                 "document.getElementById('key-form').requestSubmit()", KEY)
    _wait(browser, lambda d: _js(d, "return document.getElementById('model').textContent") == MODEL, "model shown")
    assert _js(browser, "return document.getElementById('key-form').hidden && document.getElementById('error').hidden")

    _settings(browser, max_tokens=48, thinking=False)
    # Every length the answer's source had in the page is recorded, to see it grow while the reply streams.
    _js(browser, """
        window.__lengths = [];
        new MutationObserver(() => {
          const c = [...document.querySelectorAll('.message.assistant .content')].pop();
          if (c && c.dataset.chars) window.__lengths.push(Number(c.dataset.chars));
        }).observe(document.getElementById('conversation'),
                   {subtree: true, attributes: true, attributeFilter: ['data-chars']});
    """)
    _send(browser, "Say hello.")
    _wait(browser, lambda d: _last_state(d) in ("done", "error", "stopped"), "reply finished")
    assert _last_state(browser) == "done", _js(browser, "return document.getElementById('error').textContent")
    text = _js(browser, "return [...document.querySelectorAll('.message.assistant .content')].pop().textContent")
    assert text.strip()
    lengths = [n for n in _js(browser, "return window.__lengths") if n]
    assert len(set(lengths)) >= 2 and lengths == sorted(lengths), lengths   # it grew, chunk by chunk
    # The conversation is kept: a second turn adds to it.
    _send(browser, "And again.")
    _wait(browser, lambda d: _js(d, "return document.querySelectorAll('.message.assistant').length") == 2
          and _last_state(d) != "streaming", "second reply finished")
    assert _js(browser, "return document.querySelectorAll('.message.user').length") == 2


def test_stop_cancels_the_request_on_the_server(browser, server):
    _open_with_key(browser, server)
    before = _metrics(server)
    _settings(browser, max_tokens=MAX_CONTEXT - 128, thinking=True)
    _send(browser, "Write a long essay.")
    # The model thinks first: the thinking section appears and grows.
    _wait(browser, lambda d: _js(d, "const t = [...document.querySelectorAll('.thinking-text')].pop(); "
                                    "return t && t.textContent.length > 20"), "thinking streamed")
    assert _last_state(browser) == "streaming"
    assert _js(browser, "return ![...document.querySelectorAll('.thinking')].pop().hidden")
    _js(browser, "document.getElementById('stop').click()")
    _wait(browser, lambda d: _last_state(d) == "stopped", "page shows the reply stopped")
    assert _js(browser, "return [...document.querySelectorAll('.message.assistant .status')].pop().textContent") \
        == "stopped"
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        text = _metrics(server)
        if (_metric(text, "ninfer_engine_cancelled_total") == _metric(before, "ninfer_engine_cancelled_total") + 1
                and _metric(text, "ninfer_requests_outstanding") == 0):
            break
        assert time.monotonic() < deadline, "the stopped request was not cancelled on the server"
        time.sleep(0.1)
    generated = _metric(text, "ninfer_generation_tokens_total") - _metric(before, "ninfer_generation_tokens_total")
    assert generated < MAX_CONTEXT - 128
    assert 'outcome="cancelled"' in text


def test_a_server_error_shows_in_the_page(browser, server):
    _open_with_key(browser, server)
    _settings(browser, max_tokens=10 * MAX_CONTEXT, thinking=False)
    _send(browser, "Hi")
    _wait(browser, lambda d: _last_state(d) == "error", "the reply ends in an error")
    shown = _js(browser, "return document.getElementById('error').textContent")
    # The server's own message for the same request, in the page.
    r = httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=HANG_GUARD_S,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
                         "max_tokens": 10 * MAX_CONTEXT, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 400
    assert shown == r.json()["error"]["message"]
    # The text goes back in the box and the failed turn is not part of the conversation.
    assert _js(browser, "return document.getElementById('prompt').value") == "Hi"


def test_markdown_renderer_escapes_model_text(browser, server):
    _open_with_key(browser, server)
    render = ("const done = arguments[arguments.length - 1];"
              "import('/static/markdown.js').then(m => done(m.renderMarkdown(arguments[0])));")
    out = browser.execute_async_script(render, "# T <b>x</b>\n\n**bold** and `<i>code</i>`\n\n"
                                               "[ok](https://example.org/a?b=1&c=2) [bad](javascript:alert(1))\n\n"
                                               "- one\n- <script>alert(1)</script>\n\n```python\nif a < b:\n```")
    assert "<h1>T &lt;b&gt;x&lt;/b&gt;</h1>" in out
    assert "<strong>bold</strong>" in out and "<code>&lt;i&gt;code&lt;/i&gt;</code>" in out
    assert '<a href="https://example.org/a?b=1&amp;c=2" target="_blank" rel="noopener noreferrer">ok</a>' in out
    assert "javascript:" in out and 'href="javascript' not in out
    assert "<li>&lt;script&gt;alert(1)&lt;/script&gt;</li>" in out and "<script" not in out
    assert '<pre><code class="language-python">if a &lt; b:</code></pre>' in out
    attr = browser.execute_async_script(render, '[x](https://a.b/" onmouseover="alert(1))')
    assert "onmouseover=\"" not in attr and "&quot;" in attr
