"""Drives the built-in chat page (`GET /`) in headless Chromium through Playwright: types a
message, watches the answer stream in, sends a second turn and reads its cache line, saves a
screenshot. Prints what it saw as JSON. Environment: U_URL (the server), U_SCREENSHOT (the PNG
to write), U_CHROMIUM (the browser, default /usr/bin/chromium). Run by tests/chat_page.rs."""
import json
import os
import time

from playwright.sync_api import sync_playwright

# Flags for a closed network and a root user (no background fetches, no sandbox).
ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def answer_of(page, n):
    """The text of the n-th assistant turn (0-based), '' while absent."""
    turns = page.locator(".turn.assistant .text")
    return turns.nth(n).inner_text() if turns.count() > n else ""


# Every distinct text each assistant turn shows, recorded in the page as the DOM changes (so a
# busy machine polling slowly still sees each streamed step).
RECORD = """() => {
  window.__seen = [];
  new MutationObserver(() => {
    document.querySelectorAll('.turn.assistant .text').forEach((el, i) => {
      const seen = (window.__seen[i] = window.__seen[i] || []);
      const t = el.innerText;
      if (t && seen[seen.length - 1] !== t) seen.push(t);
    });
  }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


def wait_done(page, n, timeout=120):
    """Waits for the n-th assistant turn to finish; returns every distinct partial text it
    showed, as the page recorded them."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if page.locator(".turn.assistant.done").count() > n:
            seen = page.evaluate("(n) => window.__seen[n] || []", n)
            final = answer_of(page, n)
            if not seen or seen[-1] != final:
                seen.append(final)
            return seen
        time.sleep(0.01)
    raise TimeoutError(f"turn {n} did not finish")


with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=os.environ.get("U_CHROMIUM", "/usr/bin/chromium"), args=ARGS)
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    response = page.goto(os.environ["U_URL"])
    page.wait_for_function("document.querySelector('#model').options.length > 0")
    page.evaluate(RECORD)
    model = page.input_value("#model")
    page.fill("#system", "You are a helpful assistant. Answer briefly.")
    page.fill("#max_tokens", "48")
    page.fill("#message", "Write one sentence about the sea.")
    page.click("#send")
    first = wait_done(page, 0)
    page.fill("#message", "And one about the mountains.")
    page.press("#message", "Enter")
    second = wait_done(page, 1)
    infos = page.locator(".turn.assistant .info")
    cached = [int(infos.nth(i).get_attribute("data-cached") or -1) for i in range(2)]
    info_text = [infos.nth(i).inner_text() for i in range(2)]
    page.screenshot(path=os.environ["U_SCREENSHOT"], full_page=True)
    # Stop: a long answer cut off once it has begun.
    page.fill("#max_tokens", "400")
    page.fill("#message", "Tell me a long story about a lighthouse keeper.")
    page.click("#send")
    deadline = time.time() + 60
    while not answer_of(page, 2) and time.time() < deadline:
        time.sleep(0.01)
    page.click("#stop")
    stopped = wait_done(page, 2)
    stopped_info = infos.nth(2).inner_text()
    print(json.dumps({
        "model": model,
        "first": first,
        "second": second,
        "cached": cached,
        "info": info_text,
        "stopped": stopped[-1],
        "stopped_info": stopped_info,
        "errors": errors,
        "csp": response.headers.get("content-security-policy", ""),
    }))
    browser.close()
