"""The Accelerated UNet node in ComfyUI's browser front end, driven in headless Chromium against a real ComfyUI server
on the CPU (tests/comfy_server.py's, with the pack and the test nodes linked in, and the front end's static files):

1. the node menu's Show Advanced / Hide Advanced (right-click on the node's title): the nine advanced widgets appear
   and the node grows to fit them, then go and the node shrinks back; the state and size are saved with the workflow
   (serialized and loaded again, and after a page reload);
2. copy and paste (Ctrl+C / Ctrl+V on the canvas), the node menu's Clone and the selection toolbox's More Options >
   Duplicate, with the advanced widgets hidden and shown: the new node keeps the widget values, the state and the size; changing backend on one changes only it;
3. a workflow run from the browser (Ctrl+Enter) on a tiny seeded SD1.5 model (tests/test_comfyui_server.py's
   base_prompt): the node keeps its widgets and grows by its text box, Accel Info shows its report, no error toast or
   dialog, and nothing sd_accel.js throws; Show/Hide Advanced on the node with its text box.

Sizes are node.size, visibility the front end's own node.isWidgetVisible and the layout it computed (widget.y,
computedHeight). Prints what it saw and ends non-zero if a check failed.

Not a pytest test (pytest collects test_*.py only): it needs Chromium at /usr/bin/chromium (or SD_ACCEL_CHROMIUM) and
the Python package playwright (no browser download), and takes about a minute per ComfyUI. Run from the checkout:

    python tests/ui/check_node_ui.py [ROOT[:FRONT_END] ...]

ROOT: a ComfyUI tree (default: the pinned ../shared/hosts/ComfyUI and ../shared/hosts/ComfyUI-0.33 beside the
checkout). FRONT_END: the front end it runs with, its static folder or a folder holding comfyui_frontend_package
(pip install --no-deps --target DIR comfyui-frontend-package==X); default: the installed comfyui_frontend_package when
its version is the one ROOT's requirements.txt pins. E.g. for 0.33 (front end 1.49.6) beside 0.3.64's installed 1.27.10:

    pip install --no-deps --target /tmp/fe-1.49.6 comfyui-frontend-package==1.49.6
    python tests/ui/check_node_ui.py ../shared/hosts/ComfyUI ../shared/hosts/ComfyUI-0.33:/tmp/fe-1.49.6

SD_ACCEL_UI_SHOTS=DIR keeps a screenshot after each check there.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
# As tests/conftest.py does: the checkout importable as sd_accel through a link (tests/host_server.py imports it),
# which the server's environment leaves out (SD_ACCEL_TEST_IMPORT_DIR) so ComfyUI loads the pack from custom_nodes.
_IMPORT = tempfile.mkdtemp(prefix="sd-accel-ui-import-")
atexit.register(shutil.rmtree, _IMPORT, ignore_errors=True)
os.symlink(REPO, os.path.join(_IMPORT, "sd_accel"))
sys.path[:0] = [_IMPORT, str(TESTS)]
os.environ["SD_ACCEL_TEST_IMPORT_DIR"] = _IMPORT

import comfy_helpers as H  # noqa: E402

UNET = "SDAccelAcceleratedUNet"
ADVANCED = [f"{b}_{s}" for s in ("width", "height", "batch") for b in ("min", "opt", "max")]
CHROMIUM = os.environ.get("SD_ACCEL_CHROMIUM", "/usr/bin/chromium")

# A node's state as the front end sees it: its size, showAdvanced, and each widget's visibility and layout.
STATE_JS = """(id) => {
  const n = app.graph.getNodeById(id);
  if (!n) return null;
  const ws = (n.widgets ?? []).map((w) => ({name: w.name, visible: n.isWidgetVisible(w), y: w.y,
                                            h: w.computedHeight, value: w.value}));
  const shown = ws.filter((w) => w.visible);
  // a visible widget lies inside the node and a click on its middle finds it
  const hit = shown.every((w) => !n.getWidgetOnPos ||
                                 n.getWidgetOnPos(n.pos[0] + n.size[0] / 2, n.pos[1] + w.y + w.h / 2)?.name === w.name);
  return {id: n.id, size: [...n.size], pos: [...n.pos], showAdvanced: !!n.showAdvanced, color: n.color ?? null,
          values: Object.fromEntries(ws.map((w) => [w.name, w.value])), shown: shown.map((w) => w.name),
          inside: shown.every((w) => w.y >= 0 && w.y + w.h <= n.size[1] + 0.5), hit,
          fit: n.computeSize()[1]};
}"""


class Checker:
    def __init__(self, page, label: str, shots: Path | None) -> None:
        self.page, self.label, self.shots = page, label, shots
        self.failures: list[str] = []

    def say(self, text: str) -> None:
        print(f"[{self.label}] {text}", flush=True)

    def expect(self, ok: bool, what: str) -> None:
        self.say(("ok: " if ok else "FAILED: ") + what)
        if not ok:
            self.failures.append(what)

    def shot(self, name: str) -> None:
        if self.shots:
            label = re.sub(r"[^\w.-]+", "-", self.label)
            self.page.screenshot(path=str(self.shots / f"{label}-{name}.png"))

    def state(self, node_id) -> dict:
        return self.page.evaluate(STATE_JS, node_id)

    def ids(self) -> list:
        return self.page.evaluate("() => app.graph._nodes.map((n) => n.id)")

    def settle(self, ms: int = 400) -> None:
        self.page.wait_for_timeout(ms)  # a few frames: the canvas lays widgets out when it draws

    def client(self, gx: float, gy: float) -> tuple[float, float]:
        """Graph coordinates to the page's."""
        return self.page.evaluate("""([x, y]) => { const [cx, cy] = app.canvas.ds.convertOffsetToCanvas([x, y]);
            const r = app.canvas.canvas.getBoundingClientRect(); return [r.left + cx, r.top + cy]; }""", [gx, gy])

    def title(self, node_id) -> tuple[float, float]:
        s = self.state(node_id)
        return self.client(s["pos"][0] + 60, s["pos"][1] - 15)

    def menu(self, node_id, label: str) -> list[str]:
        """Right-click the node's title and click the menu item `label`; the menu's items."""
        self.page.mouse.click(*self.title(node_id), button="right")
        entries = self.page.locator(".litecontextmenu .litemenu-entry")
        entries.first.wait_for(timeout=5000)
        self.settle(300)
        items = [t.strip() for t in entries.all_inner_texts()]
        if label not in items:
            self.page.keyboard.press("Escape")
            self.page.mouse.click(*self.client(-400, -400))
            return items
        entries.filter(has_text=re.compile(f"^{re.escape(label)}$")).first.click()
        self.settle()
        return items

    def more_options(self, node_id, label: str) -> bool | None:
        """Select the node and click `label` in the selection toolbox's More Options menu (None where there is no
        such button, False where the menu has no such item: 1.27's has no Show Advanced)."""
        self.page.mouse.click(*self.title(node_id))
        self.settle()
        button = self.page.locator("[data-testid=more-options-button]").first
        try:
            button.wait_for(timeout=3000)  # the toolbox shows a moment after the selection
        except Exception:  # noqa: BLE001 - no toolbox
            return None
        try:
            button.click(timeout=5000)
        except Exception as e:  # noqa: BLE001 - said; 1.27's button takes no click here
            self.say(f"  the selection toolbox's More Options button took no click ({type(e).__name__})")
            self.page.keyboard.press("Escape")
            return None
        self.settle()
        item = self.page.get_by_text(label, exact=True)
        if not item.count():
            self.page.keyboard.press("Escape")
            return False
        item.first.click()
        self.settle()
        return True

    def move(self, node_id, pos) -> None:
        self.page.evaluate("([id, pos]) => { app.graph.getNodeById(id).pos = pos; app.canvas.setDirty(true, true); }",
                           [node_id, list(pos)])
        self.settle()

    def choose(self, node_id, widget: str, value: str) -> None:
        """Click a combo widget and pick `value` from its list, as a user does."""
        s = self.page.evaluate("""([id, name]) => { const n = app.graph.getNodeById(id);
            const w = n.widgets.find((w) => w.name === name);
            return [n.pos[0] + n.size[0] / 2, n.pos[1] + w.y + w.computedHeight / 2]; }""", [node_id, widget])
        self.page.mouse.click(*self.client(*s))
        self.settle(300)
        self.page.locator(".litecontextmenu .litemenu-entry").filter(
            has_text=re.compile(f"^{re.escape(value)}$")).first.click()
        self.settle()

    def clean_graph_with_node(self, pos=(200, 200)):
        return self.page.evaluate("""([x, y]) => { app.graph.clear(); const n = LiteGraph.createNode('%s');
            n.pos = [x, y]; app.graph.add(n); app.canvas.ds.offset = [0, 0]; app.canvas.ds.scale = 1;
            app.canvas.setDirty(true, true); return n.id; }""" % UNET, list(pos))

    def describe(self, s: dict) -> str:
        return (f"size {s['size'][0]:.0f}x{s['size'][1]:.0f} px, showAdvanced {s['showAdvanced']}, "
                f"{len(s['shown'])} widgets shown")

    def expect_layout(self, s: dict, what: str, advanced: bool, height: float | None = None) -> None:
        shown_adv = [w for w in ADVANCED if w in s["shown"]]
        ok = (s["showAdvanced"] == advanced and shown_adv == (ADVANCED if advanced else []) and s["inside"]
              and s["hit"] and (height is None or abs(s["size"][1] - height) < 0.5))
        self.expect(ok, f"{what}: {self.describe(s)}" + ("" if height is None else f" (expected height {height:.0f})")
                    + ("" if s["inside"] else "; a shown widget lies outside the node")
                    + ("" if s["hit"] else "; a click on a shown widget misses it"))


# ------------------------------------------------------------------------------------------------ the checks

def check_menu(c: Checker, reload) -> None:
    """1. Show Advanced / Hide Advanced from the node menu, saved with the workflow."""
    node = c.clean_graph_with_node()
    c.settle()
    new = c.state(node)
    c.expect_layout(new, "new node", False)
    items = c.menu(node, "Show Advanced")
    c.expect("Show Advanced" in items, f"the node menu offers Show Advanced ({', '.join(i for i in items if i)})")
    shown = c.state(node)
    c.expect_layout(shown, "after the menu's Show Advanced", True, shown["fit"])
    c.expect(shown["size"][1] > new["size"][1], f"the node grew from {new['size'][1]:.0f} to {shown['size'][1]:.0f} px")
    c.shot("1-shown")
    # the workflow as Export writes it (JSON) and as opening that file loads it
    saved = c.page.evaluate("() => JSON.stringify(app.graph.serialize())")
    (entry,) = json.loads(saved)["nodes"]
    c.expect(entry.get("showAdvanced") is True and entry["size"] == shown["size"],
             f"serialized: showAdvanced {entry.get('showAdvanced')}, size {entry['size']}")
    for how in ("loaded again", "after a page reload"):
        if how == "loaded again":
            c.page.evaluate("(d) => app.loadGraphData(JSON.parse(d))", saved)
        else:
            reload()
        c.settle(800)
        again = c.state(node)
        c.expect(again is not None and again["showAdvanced"] and again["size"] == shown["size"]
                 and again["shown"] == shown["shown"], f"{how}: " + (c.describe(again) if again else "no node"))
    items = c.menu(node, "Hide Advanced")
    c.expect("Hide Advanced" in items, "the node menu then offers Hide Advanced")
    hidden = c.state(node)
    c.expect_layout(hidden, "after the menu's Hide Advanced", False, new["size"][1])
    c.shot("1-hidden")
    saved = c.page.evaluate("() => JSON.stringify(app.graph.serialize())")
    (entry,) = json.loads(saved)["nodes"]
    c.expect(not entry.get("showAdvanced") and entry["size"] == hidden["size"],
             f"serialized: showAdvanced {entry.get('showAdvanced')}, size {entry['size']}")
    c.page.evaluate("(d) => app.loadGraphData(JSON.parse(d))", saved)
    c.settle(800)
    again = c.state(node)
    c.expect(not again["showAdvanced"] and again["size"] == hidden["size"], f"loaded again: {c.describe(again)}")
    # Said, not counted: 1.49.6's toolbox menu calls the item with no node (contextMenuConverter passes the menu item
    # where LGraphCanvas.onMenuToggleAdvanced takes the node), which throws NullGraphError for any node.
    if c.more_options(node, "Show Advanced"):
        s = c.state(node)
        c.say(f"  the selection toolbox's More Options > Show Advanced: {c.describe(s)}"
              + ("" if s["showAdvanced"] else " (nothing happened: the front end's own error, not counted)"))
        if s["showAdvanced"]:
            c.expect_layout(s, "after More Options > Show Advanced", True, s["fit"])


def check_copy_paste(c: Checker) -> None:
    """2. Ctrl+C / Ctrl+V and the menu's Clone keep values, state and size; the copies change independently."""
    for advanced in (False, True):
        kind = "shown" if advanced else "hidden"
        node = c.clean_graph_with_node()
        c.settle()
        if advanced:
            c.menu(node, "Show Advanced")
        # values other than the defaults, so that a copy with the defaults would show
        c.page.evaluate("""(id) => { const n = app.graph.getNodeById(id);
            n.widgets.find((w) => w.name === 'cuda_graphs').value = false;
            n.widgets.find((w) => w.name === 'max_width').value = 2048;
            n.widgets.find((w) => w.name === 'precision').value = 'fp8'; app.canvas.setDirty(true, true); }""", node)
        c.settle()
        original = c.state(node)
        c.page.mouse.click(*c.title(node))  # select it
        c.page.keyboard.press("Control+c")
        c.page.mouse.move(*c.client(520 + 60, 200))
        c.page.keyboard.press("Control+v")
        c.settle(800)
        (pasted,) = [i for i in c.ids() if i != node] or [None]
        copies = [("pasted", pasted)]
        before = set(c.ids())
        items = c.menu(node, "Clone")
        cloned = [i for i in c.ids() if i not in before]
        if cloned:
            copies.append(("cloned", cloned[0]))
            c.move(cloned[0], (840, 200))  # beside the others: clicks on its widgets must hit it
        else:
            c.say(f"no Clone in the node menu ({', '.join(i for i in items if i)})")
        before = set(c.ids())
        found = c.more_options(node, "Duplicate")
        duplicated = [i for i in c.ids() if i not in before]
        if duplicated:
            copies.append(("duplicated", duplicated[0]))
            c.move(duplicated[0], (1160, 200))
        else:
            c.say(f"More Options > Duplicate made no node (the item {'found' if found else 'not found'})")
        for how, copy in copies:
            s = c.state(copy) if copy is not None else None
            c.expect(s is not None and s["values"] == original["values"] and s["showAdvanced"] == advanced
                     and s["size"] == original["size"] and s["shown"] == original["shown"] and s["inside"],
                     f"advanced {kind}, {how}: " + (c.describe(s) + f", values {'the same' if s['values'] == original['values'] else s['values']}" if s else "no new node"))
        c.shot(f"2-{kind}-copies")
        # backend on one copy: that one shows or hides its advanced widgets, the others stay as they were
        other = "torch" if advanced else "onnxruntime"
        for how, copy in copies:
            c.choose(copy, "backend", other)
            s = c.state(copy)
            fit = s["fit"]
            c.expect_layout(s, f"advanced {kind}, {how} node set to backend {other}", not advanced, fit)
            c.expect(s["values"]["backend"] == other, f"its backend is {s['values']['backend']}")
            rest = [c.state(i) for i in [node] + [i for _, i in copies if i != copy]]
            c.expect(all(r["values"]["backend"] == "auto" and r["showAdvanced"] == advanced
                         and r["size"] == original["size"] for r in rest),
                     "the other nodes unchanged: " + "; ".join(c.describe(r) + f", backend {r['values']['backend']}"
                                                              for r in rest))
            c.choose(copy, "backend", "auto")
            if advanced:  # auto hides nothing; show them again where they were shown
                c.menu(copy, "Show Advanced")
            back = c.state(copy)
            c.expect(back["showAdvanced"] == advanced and back["size"] == original["size"],
                     f"{how} node back to auto" + (" and Show Advanced" if advanced else "") + f": {c.describe(back)}")
        c.shot(f"2-{kind}-after")


TOASTS_JS = """() => ({
    toasts: [...document.querySelectorAll('.p-toast-message')].map((e) => e.innerText.trim()),
    dialogs: [...document.querySelectorAll('.p-dialog, .comfy-modal, [role=dialog]')]
               .filter((e) => e.offsetParent !== null).map((e) => e.innerText.trim().slice(0, 300))})"""


def check_run(c: Checker, server, reload) -> None:
    """3. A workflow run from the browser: the node and Accel Info after it."""
    from test_comfyui_server import base_prompt  # the workflow the server tests queue

    # A fresh page: front end 1.49 keeps widget values per graph id and node id (its widgetValueStore), and once
    # app.graph.clear() has reset the graph's id it no longer drops them, so the checks' earlier nodes would lend
    # theirs (precision fp8 above) to the inputs this API workflow leaves out (precision, gpus).
    reload()
    c.page.evaluate("(p) => app.loadApiJson(p, 'sd-accel-ui-check.json')", base_prompt("ui"))
    c.settle(1000)
    types = c.page.evaluate("() => Object.fromEntries(app.graph._nodes.map((n) => [n.id, n.type]))")
    unet = next(int(i) for i, t in types.items() if t == UNET)
    # the node at (200, 200) on the page at scale 1, with room below for its text box and advanced widgets
    c.page.evaluate("""(id) => { const n = app.graph.getNodeById(id); app.canvas.ds.scale = 1;
        app.canvas.ds.offset = [200 - n.pos[0], 200 - n.pos[1]]; app.canvas.setDirty(true, true); }""", unet)
    info = next((int(i) for i, t in types.items() if t == "SDAccelInfo"), None)
    before = c.state(unet)
    c.expect_layout(before, "before the run", False)
    toasts_before = c.page.evaluate(TOASTS_JS)
    c.page.keyboard.press("Control+Enter")  # the front end's Queue Prompt
    wait = "(id) => app.graph.getNodeById(id)?.widgets?.some((w) => w.name === 'sd_accel_text' && w.value)"
    try:
        c.page.wait_for_function(wait, arg=info if info is not None else unet, timeout=240_000)
    except Exception as e:  # noqa: BLE001 - said and counted
        c.expect(False, f"the run's text did not arrive: {e}\n{server.log()[-3000:]}")
        return
    c.settle(1500)
    after = c.state(unet)
    text = after["values"].get("sd_accel_text") or ""
    c.expect_layout(after, "after the run", False, None)
    c.expect(after["size"][1] >= before["size"][1] and after["shown"] == before["shown"] + ["sd_accel_text"],
             f"the node keeps its widgets and grew by its text box, {before['size'][1]:.0f} -> "
             f"{after['size'][1]:.0f} px; title colour {after['color']}")
    c.expect(text.startswith("path: torch"), "its text:\n    " + "\n    ".join(text.splitlines()))
    # what ran is what the node shows
    deadline = time.monotonic() + 120  # Accel Info's text can come before the prompt ends and is filed
    while not (history := server.get("/history")) and time.monotonic() < deadline:
        time.sleep(0.5)
    c.expect(len(history) == 1, f"one prompt ran on the server ({len(history)})")
    entry = list(history.values())[-1]
    inputs = entry["prompt"][2][str(unet)]["inputs"]
    c.say(f"  the node's inputs in it: { {k: v for k, v in inputs.items() if k != 'model'} }")
    differ = {k: (v, inputs.get(k)) for k, v in before["values"].items() if k in inputs and inputs[k] != v}
    c.expect(not differ, f"the queued prompt has the node's widget values (differ: {differ})")
    if info is not None:
        s = c.state(info)
        report = s["values"].get("sd_accel_text") or ""
        c.expect(report.startswith("model: ") and s["inside"],
                 f"Accel Info: size {s['size'][0]:.0f}x{s['size'][1]:.0f} px, its report's first line: "
                 f"{report.splitlines()[:1]}")
    ui = c.page.evaluate(TOASTS_JS)
    toasts = [t for t in ui["toasts"] if t not in toasts_before["toasts"]]
    c.expect(not toasts and not ui["dialogs"], f"no toast or dialog since the run was queued (toasts {toasts}, "
             f"dialogs {ui['dialogs']})")
    c.shot("3-after-run")
    # Show/Hide Advanced with the text box: the nine widgets' room added and taken away, the text box's kept
    c.menu(unet, "Show Advanced")
    shown = c.state(unet)
    c.expect_layout(shown, "after the run, Show Advanced", True)
    c.expect(shown["size"][1] > after["size"][1], f"grew {after['size'][1]:.0f} -> {shown['size'][1]:.0f} px")
    c.shot("3-shown")
    c.menu(unet, "Hide Advanced")
    c.expect_layout(c.state(unet), "then Hide Advanced", False, after["size"][1])


# ------------------------------------------------------------------------------------------------ running it

def pinned_front_end(root: Path) -> str | None:
    text = (root / "requirements.txt").read_text() if (root / "requirements.txt").is_file() else ""
    m = re.search(r"comfyui-frontend-package==([\w.]+)", text)
    return m.group(1) if m else None


def front_end_for(root: Path, named: str | None) -> Path:
    if named:
        path = Path(named).resolve()
        for static in (path, path / "comfyui_frontend_package" / "static"):
            if (static / "index.html").is_file():
                return static
        raise SystemExit(f"{named}: no front end there (index.html or comfyui_frontend_package/static/index.html)")
    want = pinned_front_end(root)
    try:
        import comfyui_frontend_package
        from importlib.metadata import version
        have = version("comfyui_frontend_package")
    except Exception:  # noqa: BLE001 - not installed, or without its metadata
        have = None
    if have is None or (want and have != want):
        raise SystemExit(f"{root} wants front end {want}; installed: {have}. Give ROOT:FRONT_END, e.g. pip install "
                         f"--no-deps --target /tmp/fe-{want} comfyui-frontend-package=={want}, then "
                         f"{root}:/tmp/fe-{want}")
    return Path(comfyui_frontend_package.__file__).parent / "static"


def run_host(root: Path, front_end: Path, shots: Path | None) -> list[str]:
    from playwright.sync_api import sync_playwright

    os.environ["COMFYUI_ROOT"] = str(root)
    why = H.comfy_unavailable(server=True)
    if why:
        raise SystemExit(why)
    from comfy_server import Server

    label = f"ComfyUI {root.name}"
    base = Path(H.temporary_folder("sd-accel-ui-comfyui-"))
    started = time.monotonic()
    server = Server(base, startup_timeout=300, front_end=front_end)
    failures: list[str] = []
    try:
        print(f"[{label}] server {server.url} up in {time.monotonic() - started:.0f} s, front end {front_end}",
              flush=True)
        # a returning user: no first-run template browser over the canvas
        request = urllib.request.Request(f"{server.url}/settings", method="POST",
                                         data=json.dumps({"Comfy.TutorialCompleted": True}).encode())
        urllib.request.urlopen(request, timeout=30).close()
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1600, "height": 1000})
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(f"{e}\n{e.stack or ''}"))
                page.on("console", lambda m: errors.append(f"{m.text}\n{json.dumps(m.location)}")
                        if m.type == "error" else None)

                def load() -> None:
                    page.goto(server.url)
                    page.wait_for_function("() => !!(window.app?.graph && window.LiteGraph?.registered_node_types"
                                           f"?.['{UNET}'])", timeout=180_000)
                    page.wait_for_timeout(1500)

                load()
                version = page.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__ ?? null")
                c = Checker(page, f"{label} / front end {version}", shots)
                for name, check in (("1 Show/Hide Advanced", lambda: check_menu(c, load)),
                                    ("2 copy and paste", lambda: check_copy_paste(c)),
                                    ("3 after a run", lambda: check_run(c, server, load))):
                    c.say(f"--- check {name}")
                    try:
                        check()
                    except Exception as e:  # noqa: BLE001 - a check that cannot go on is a failure; go to the next
                        c.expect(False, f"check {name} stopped: {type(e).__name__}: {e}")
                ours = [e for e in errors if "sd_accel.js" in e]
                c.expect(not ours, f"nothing from sd_accel.js in the console ({len(errors)} errors in all"
                         + (f"; ours: {ours}" if ours else "") + ")")
                for e in sorted(set(errors)):  # the rest, for the reader to judge
                    c.say("  console error (not sd_accel.js): " + " | ".join(e.splitlines()[:3])[:300])
                failures = c.failures
            finally:
                browser.close()
    finally:
        server.stop()
    return failures


def main(argv: list[str]) -> int:
    hosts = argv or [str(p) for p in (H.HOSTS / "ComfyUI", H.HOSTS / "ComfyUI-0.33") if p.is_dir()]
    if not hosts:
        raise SystemExit(f"no ComfyUI given and none at {H.HOSTS}")
    if not Path(CHROMIUM).is_file():
        raise SystemExit(f"no Chromium at {CHROMIUM} (SD_ACCEL_CHROMIUM names another)")
    shots = Path(os.environ["SD_ACCEL_UI_SHOTS"]) if os.environ.get("SD_ACCEL_UI_SHOTS") else None
    if shots:
        shots.mkdir(parents=True, exist_ok=True)
    failed = {}
    for host in hosts:  # one server at a time
        root, _, named = host.partition(":")
        root = Path(root).resolve()
        failures = run_host(root, front_end_for(root, named or None), shots)
        if failures:
            failed[str(root)] = failures
    for root, failures in failed.items():
        print(f"{root}: {len(failures)} failed:\n  " + "\n  ".join(failures))
    print("all checks passed" if not failed else "some checks failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
