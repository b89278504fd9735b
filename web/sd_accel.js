// sd-accel front-end: shows on the Accelerated UNet node which path serves the UNet, where its engine came from
// (built now or loaded from the cache), build progress, and the messages the pack said; shows Accel Info's report.
// The server side sends "sd-accel.status" events (nodes/comfy_ui.py) and each node's text in its "executed" output.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { ComfyWidgets } from "../../scripts/widgets.js";

const UNET = "SDAccelAcceleratedUNet";
const INFO = "SDAccelInfo";
const TEXT_NODES = [UNET, INFO, "SDAccelTiledVAEDecode", "SDAccelTiledVAEEncode"];

// Title colours by path: the engine path, the torch path, and the plain model (nothing accelerated).
const PATH_COLOURS = {
  onnxruntime: "#2a4a6d",
  torch: "#3d4f2a",
  plain: "#6d4a2a",
};

function textWidget(node, name) {
  let widget = node.widgets?.find((w) => w.name === name);
  if (!widget) {
    widget = ComfyWidgets.STRING(node, name, ["STRING", { multiline: true }], app).widget;
    widget.serialize = false; // shown, never sent back with the workflow
    if (widget.inputEl) {
      widget.inputEl.readOnly = true;
      widget.inputEl.style.opacity = 0.8;
    }
    // The widget is added after the node was sized: grow it so the text box lies inside the node, with room for
    // several lines (never shrink what the user set).
    const [w, h] = node.computeSize();
    node.setSize([Math.max(node.size[0], w), Math.max(node.size[1], h + 100)]);
  }
  return widget;
}

function showText(node, text) {
  textWidget(node, "sd_accel_text").value = text;
  node.setDirtyCanvas(true, true);
}

function statusLines(s) {
  const lines = [];
  if (s.backend) lines.push(`path: ${s.backend}${s.source ? ` (${s.source})` : ""}`);
  if (s.engine_calls !== undefined) {
    lines.push(`last run: ${s.engine_calls} accelerated calls, ${s.plain_calls} on the plain model`);
  }
  if (s.gpus) lines.push(s.gpus);
  for (const m of s.messages ?? []) lines.push(`note: ${m}`);
  return lines;
}

function findNode(id) {
  // Nodes inside subgraphs report ids like "12:5"; the last part is the node in its own graph.
  const graph = app.graph;
  return graph?.getNodeById(Number(id)) ?? graph?.getNodeById(Number(String(id).split(":").pop()));
}

function onStatus(event) {
  const d = event.detail;
  const node = findNode(d.node);
  if (!node) return;
  const state = (node.sdAccel ??= { progress: null, status: {}, planned: "" });
  if (d.kind === "build" || d.kind === "vae") {
    state.progress = d.fraction >= 1 ? null : { stage: d.stage, fraction: d.fraction, eta: d.eta };
  } else if (d.kind === "status") {
    state.status = d;
    state.progress = null;
  } else if (d.kind === "planned") {
    state.planned = d.text;
    state.status = { backend: `${d.backend} (planned, builds on the first step)` };
  } else if (d.kind === "message") {
    state.status.messages = [...new Set([...(state.status.messages ?? []), d.message])];
  }
  if (node.type === UNET) {
    const path = (state.status.backend ?? "").split(" ")[0];
    if (PATH_COLOURS[path]) node.color = PATH_COLOURS[path];
    showText(node, [...statusLines(state.status), state.planned].filter(Boolean).join("\n"));
  } else if (d.kind === "message") {
    showText(node, state.status.messages.join("\n"));
  }
  node.setDirtyCanvas(true, true);
}

function drawProgress(node, ctx) {
  const p = node.sdAccel?.progress;
  if (!p || node.flags?.collapsed) return;
  const width = node.size[0];
  const y = -(globalThis.LiteGraph?.NODE_TITLE_HEIGHT ?? 30) - 4;
  ctx.save();
  ctx.fillStyle = "#222";
  ctx.fillRect(0, y, width, 4);
  ctx.fillStyle = "#4caf50";
  ctx.fillRect(0, y, width * Math.max(0, Math.min(1, p.fraction)), 4);
  ctx.fillStyle = "#ddd";
  ctx.font = "11px sans-serif";
  const eta = p.eta ? `, ${Math.round(p.eta)} s left` : "";
  ctx.fillText(`${p.stage} ${Math.round(100 * p.fraction)}%${eta}`, 4, y - 4);
  ctx.restore();
}

// The Accelerated UNet's nine shape inputs are declared advanced (nodes/accelerated_unet.py): only the onnxruntime
// backend reads them. The front end's canvas hides a widget by its own `advanced` flag, which it does not take from
// the declaration (1.27, 1.49; its Vue nodes do): set it, so they are hidden until the node shows its advanced inputs
// (its menu's Show Advanced, saved with the workflow, or choosing backend onnxruntime).
// The canvas skips such a widget when it draws and measures the node (computeSize) but still lays it out
// (_arrangeWidgets, 1.27 and 1.49), growing the node to the height of all its widgets on the next frame, saved size or
// not: while hidden it takes no room.
function markAdvanced(node) {
  for (const w of node.widgets ?? []) {
    if (!w.options?.advanced) continue;
    w.advanced = true;
    const computeSize = w.computeSize;
    w.computeSize = function (width) {
      if (!node.showAdvanced) return [0, -4]; // the layout adds 4 per widget
      const height = globalThis.LiteGraph?.NODE_WIDGET_HEIGHT ?? 20;
      return computeSize?.apply(this, arguments) ?? [width ?? node.size[0], height];
    };
  }
}

// change() shows or hides the advanced widgets: the node grows or shrinks by what they take, keeping any room the user
// or the text box added.
function resizeAround(node, change) {
  const before = node.computeSize()[1];
  const height = node.size[1];
  const r = change();
  const after = node.computeSize()[1];
  node.setSize([node.size[0], Math.max(after, height + after - before)]);
  node.setDirtyCanvas(true, true);
  return r;
}

function showAdvanced(node, show) {
  if (!!node.showAdvanced === show) return;
  resizeAround(node, () => {
    node.showAdvanced = show;
  });
}

function backendWidget(node) {
  return node.widgets?.find((w) => w.name === "backend");
}

app.registerExtension({
  name: "sd-accel.status",
  setup() {
    api.addEventListener("sd-accel.status", onStatus);
  },
  nodeCreated(node) {
    if (node.comfyClass !== UNET) return;
    markAdvanced(node);
    // The front end sized the node before nodeCreated, counting the widgets just hidden: fit the height to the
    // widgets shown. A node loaded from a workflow (or pasted) is configured after this and takes its saved size.
    node.setSize([node.size[0], node.computeSize()[1]]);
    const backend = backendWidget(node);
    if (!backend) return;
    const callback = backend.callback;
    backend.callback = function (value) {
      const r = callback?.apply(this, arguments);
      showAdvanced(node, value === "onnxruntime");
      return r;
    };
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name === UNET) {
      // The node menu's Show/Hide Advanced (toggleAdvanced, 1.27 and 1.49) only ever grows the node
      // (expandToFitContent): Hide would leave the room the nine widgets took.
      const toggleAdvanced = nodeType.prototype.toggleAdvanced;
      if (toggleAdvanced) {
        nodeType.prototype.toggleAdvanced = function () {
          return resizeAround(this, () => toggleAdvanced.apply(this, arguments));
        };
      }
      const onConfigure = nodeType.prototype.onConfigure;
      nodeType.prototype.onConfigure = function (info) {
        const r = onConfigure?.apply(this, arguments);
        // A workflow saved before the inputs were advanced has no showAdvanced: show them where they are used.
        if (info.showAdvanced === undefined && backendWidget(this)?.value === "onnxruntime") showAdvanced(this, true);
        return r;
      };
    }
    if (!TEXT_NODES.includes(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = message?.text?.join("\n");
      if (!text) return;
      if (nodeData.name === UNET) {
        const state = (this.sdAccel ??= { progress: null, status: {}, planned: "" });
        state.planned = text;
        showText(this, [...statusLines(state.status), text].filter(Boolean).join("\n"));
      } else {
        showText(this, text);
      }
    };
    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      const r = onDrawForeground?.apply(this, arguments);
      drawProgress(this, ctx);
      return r;
    };
  },
});
