// Small helpers shared by the dashboard's views: DOM and SVG elements,
// colours, number formats, time axes. Plain ES module, no dependencies.

export const SVG_NS = 'http://www.w3.org/2000/svg';

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === 'dataset') Object.assign(node.dataset, v);
    else if (k in node && k !== 'style') node[k] = v;
    else node.setAttribute(k, v);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined)
      .map((c) => (c instanceof Node ? c : String(c))));
  return node;
}

export function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === 'dataset') Object.assign(node.dataset, v);
    else node.setAttribute(k, v);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined)
      .map((c) => (c instanceof Node ? c : String(c))));
  return node;
}

export function title(text) {
  return svg('title', {}, text);
}

export const PHASES = ['compute', 'wait', 'comm'];
export const PHASE_NAMES = {compute: 'compute', wait: 'wait',
                            comm: 'communicate'};
export const PHASE_RGB = {compute: [67, 160, 71], wait: [229, 57, 53],
                          comm: [30, 136, 229]};
export const WAIT_IN_GROUP_RGB = [214, 214, 214];

export function rgb(c) {
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

// A group's colour, keyed by its lowest member: stable across rounds and
// distinct for neighbours (golden-angle hues from blue, away from the
// phases' red for waits).
export function groupRgb(group) {
  const h = (210 + group * 137.508) % 360;
  const s = 0.6;
  const l = 0.5;
  const f = (n) => {
    const k = (n + h / 30) % 12;
    const a = s * Math.min(l, 1 - l);
    return Math.round(255 * (l - a * Math.max(-1, Math.min(k - 3, 9 - k, 1))));
  };
  return [f(0), f(8), f(4)];
}

// A worker's line colour in the charts.
export function workerColour(worker, count) {
  const h = count > 1 ? (worker * 360 / count) % 360 : 210;
  return `hsl(${h.toFixed(0)}, 65%, 42%)`;
}

export function fmt(x, digits = 2) {
  return Number.isFinite(x) ? x.toFixed(digits) : '–';
}

export function pct(x) {
  return Number.isFinite(x) ? `${(100 * x).toFixed(1)} %` : '–';
}

export function seconds(t) {
  if (!Number.isFinite(t)) return '–';
  if (t === 0) return '0 s';
  const a = Math.abs(t);
  if (a >= 3600) return `${(t / 3600).toFixed(2)} h`;
  if (a >= 60) return `${(t / 60).toFixed(1)} min`;
  if (a >= 1) return `${t.toFixed(a >= 10 ? 1 : 2)} s`;
  return `${(1000 * t).toFixed(a >= 0.01 ? 0 : 2)} ms`;
}

// About `count` round numbers covering [lo, hi].
export function ticks(lo, hi, count = 6) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + 1e-12; t += step) {
    out.push(Number(t.toPrecision(12)));
  }
  return out;
}

export function decodeBytes(b64) {
  const text = atob(b64);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  return bytes;
}

// The server sends little-endian uint16s; read them as such on any host.
export function decodeU16(b64) {
  const bytes = decodeBytes(b64);
  const view = new DataView(bytes.buffer);
  const out = new Uint16Array(bytes.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = view.getUint16(2 * i, true);
  return out;
}

export async function getJson(url) {
  const response = await fetch(url);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || `${url}: ${response.status}`);
  return body;
}
