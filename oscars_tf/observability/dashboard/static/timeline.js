// The timeline view: one row per worker over wall time, each round's
// compute / wait / communicate spans (Gantt-style), events marked.
//
// The server sends either every span in the window ("exact": drawn as SVG
// rects, one <title> each) or, past a few thousand spans, each row cut into
// pixel columns with the share of each phase ("binned": drawn on a canvas,
// one pixel column per column, the phases' colours mixed by their share).
// An SVG overlay carries the axis, the labels, the events and the zoom:
// wheel to zoom at the pointer (shift+wheel pans), drag to zoom to a range,
// double-click to zoom out fully.

import {PHASES, PHASE_NAMES, PHASE_RGB, WAIT_IN_GROUP_RGB, decodeBytes,
  decodeU16, el, groupRgb, rgb, seconds, svg, ticks, title} from './util.js';

const LABEL_W = 84;
const RIGHT_W = 14;
const AXIS_H = 22;
const STRIP_H = 16;  // cluster-wide events above the rows
const NO_GROUP = 0xFFFF;

export const EVENT_STYLE = {
  dropped: {glyph: '✕', colour: '#b71c1c', label: 'dropped'},
  rejoined: {glyph: '▲', colour: '#1b5e20', label: 'rejoined'},
  poisoned: {glyph: '◆', colour: '#e65100', label: 'poisoned (left out)'},
  period: {glyph: 'P', colour: '#6a1b9a', label: 'period change'},
  global_sync: {glyph: '│', colour: '#455a64', label: 'global sync'},
  epoch_end: {glyph: 'E', colour: '#000000', label: 'epoch end'},
};

function rowHeight(workers) {
  return Math.max(2, Math.min(22, Math.floor(560 / Math.max(1, workers))));
}

function phaseColour(phase, group, colourBy) {
  if (colourBy !== 'group' || group < 0 || group === NO_GROUP) {
    return PHASE_RGB[phase];
  }
  if (phase === 'wait') return WAIT_IN_GROUP_RGB;
  const c = groupRgb(group);
  return phase === 'comm' ? c.map((v) => Math.round(v * 0.6)) : c;
}

export function timelineLegend(colourBy, groups) {
  const items = colourBy === 'group' ?
    [...groups.slice(0, 12).map((g) => [`group ${g}`, rgb(groupRgb(g))]),
     ['wait', rgb(WAIT_IN_GROUP_RGB)]] :
    PHASES.map((p) => [PHASE_NAMES[p], rgb(PHASE_RGB[p])]);
  return el('div', {className: 'legend'},
      ...items.map(([name, colour]) => el('span', {className: 'key'},
          el('i', {style: `background:${colour}`}), name)),
      ...Object.values(EVENT_STYLE).map((s) => el('span', {className: 'key'},
          el('b', {style: `color:${s.colour}`}, s.glyph), s.label)));
}

// view: the server's /timeline answer; opts: {t0, t1, width, colourBy,
// onWindow(t0, t1) | onWindow(null)}.
export function renderTimeline(view, opts) {
  const n = view.workers.length;
  const rowH = rowHeight(n);
  const plotW = opts.width - LABEL_W - RIGHT_W;
  const plotH = n * rowH;
  const height = AXIS_H + STRIP_H + plotH + 4;
  const top = AXIS_H + STRIP_H;
  const {t0, t1} = opts;
  const x = (t) => LABEL_W + (t - t0) / (t1 - t0) * plotW;
  const rowOf = new Map(view.workers.map((w, i) => [w, i]));

  const root = svg('svg', {
    class: 'oscars-timeline', width: opts.width, height,
    dataset: {mode: view.mode, workers: n, rounds: view.rounds,
              segments: view.segments, events: view.events.length,
              t0, t1}});
  const wrap = el('div', {className: 'timeline-wrap',
                          style: `height:${height}px`});

  // Axis and rows.
  const axis = svg('g', {class: 'axis'});
  for (const t of ticks(t0, t1, Math.max(2, Math.round(plotW / 110)))) {
    axis.append(svg('line', {x1: x(t), x2: x(t), y1: AXIS_H - 4,
                             y2: top + plotH, class: 'grid'}),
        svg('text', {x: x(t), y: AXIS_H - 7, 'text-anchor': 'middle'},
            seconds(t)));
  }
  root.append(axis);
  const labels = svg('g', {class: 'labels'});
  const every = Math.ceil(11 / rowH);  // a label per ~11 px
  view.workers.forEach((w, i) => {
    if (i % every) return;
    labels.append(svg('text', {
      class: 'worker-label', x: LABEL_W - 6, y: top + i * rowH + rowH / 2 + 4,
      'text-anchor': 'end', dataset: {worker: w}}, `worker ${w}`));
  });
  root.append(labels);

  if (view.mode === 'exact') {
    root.append(exactSpans(view, opts.colourBy, x, top, rowH));
  } else {
    const canvas = binnedCanvas(view, opts.colourBy, plotW, rowH);
    canvas.style.left = `${LABEL_W}px`;
    canvas.style.top = `${top}px`;
    wrap.append(canvas);
    addBinnedTooltip(root, view, {x0: LABEL_W, plotW, top, rowH, t0, t1});
  }
  root.append(eventMarks(view.events, rowOf, x, top, rowH, plotH));
  addZoom(root, opts, {x0: LABEL_W, plotW, top: AXIS_H, plotH: height});
  wrap.append(root);
  return wrap;
}

function exactSpans(view, colourBy, x, top, rowH) {
  const g = svg('g', {class: 'spans'});
  view.rows.forEach((rows, i) => {
    const worker = view.workers[i];
    const y = top + i * rowH + (rowH > 4 ? 1 : 0);
    const h = Math.max(1, rowH - (rowH > 4 ? 2 : 0));
    for (const [round, start, compute, wait, comm, group, overlap] of rows) {
      if (overlap > 0) {  // overlap=True: under the next round's compute
        const x0 = x(start + compute + wait + comm);
        g.append(svg('rect', {
          class: 'seg overlap', x: x0.toFixed(2), y: y + h * 2 / 3,
          width: Math.max(0.5, x(start + compute + wait + comm + overlap) -
                          x0).toFixed(2),
          height: Math.max(1, h / 3), fill: rgb(phaseColour('comm', group,
                                                             colourBy)),
          dataset: {worker, round, phase: 'overlap'}},
        title(`worker ${worker} · round ${round} · group ${group}\n` +
              `averaging in flight beside compute ${seconds(overlap)}`)));
      }
      let at = start;
      [compute, wait, comm].forEach((dur, p) => {
        const phase = PHASES[p];
        const x0 = x(at);
        const w = Math.max(0.5, x(at + dur) - x0);
        at += dur;
        g.append(svg('rect', {
          class: `seg ${phase}`, x: x0.toFixed(2), y, width: w.toFixed(2),
          height: h, fill: rgb(phaseColour(phase, group, colourBy)),
          dataset: {worker, round, phase}},
        title(`worker ${worker} · round ${round} · group ${group}\n` +
              `${PHASE_NAMES[phase]} ${seconds(dur)} ` +
              `(from ${seconds(at - dur)})`)));
      });
    }
  });
  return g;
}

// One pixel column per server column, each cell the phases' colours mixed
// by their share of the column's time (white: not in a round).
function binnedCanvas(view, colourBy, plotW, rowH) {
  const n = view.workers.length;
  const cols = view.width;
  const shares = decodeBytes(view.shares);
  const groups = decodeU16(view.group_cells);
  const canvas = el('canvas', {className: 'binned', width: cols,
                               height: n * rowH});
  canvas.style.width = `${plotW}px`;
  canvas.style.height = `${n * rowH}px`;
  const ctx = canvas.getContext('2d');
  const image = ctx.createImageData(cols, n * rowH);
  const px = image.data;
  const gap = rowH > 4 ? 1 : 0;
  for (let i = 0; i < n; i++) {
    for (let c = 0; c < cols; c++) {
      const group = groups[i * cols + c];
      let r = 0;
      let gr = 0;
      let b = 0;
      let used = 0;
      for (let p = 0; p < 3; p++) {
        const s = shares[(i * 3 + p) * cols + c] / 255;
        const colour = phaseColour(PHASES[p], group, colourBy);
        r += s * colour[0];
        gr += s * colour[1];
        b += s * colour[2];
        used += s;
      }
      const idle = Math.max(0, 1 - used);
      for (let y = gap; y < rowH - gap; y++) {
        const o = ((i * rowH + y) * cols + c) * 4;
        px[o] = r + idle * 255;
        px[o + 1] = gr + idle * 255;
        px[o + 2] = b + idle * 255;
        px[o + 3] = 255;
      }
    }
  }
  ctx.putImageData(image, 0, 0);
  canvas.dataset.cells = String(n * cols);
  return canvas;
}

function addBinnedTooltip(root, view, box) {
  const shares = decodeBytes(view.shares);
  const groups = decodeU16(view.group_cells);
  const tip = svg('title', {}, '');
  const hit = svg('rect', {class: 'hit', x: box.x0, y: box.top,
                           width: box.plotW,
                           height: view.workers.length * box.rowH,
                           fill: 'transparent'}, tip);
  hit.addEventListener('mousemove', (e) => {
    const r = root.getBoundingClientRect();
    const c = Math.floor((e.clientX - r.left - box.x0) / box.plotW *
                         view.width);
    const i = Math.floor((e.clientY - r.top - box.top) / box.rowH);
    if (c < 0 || c >= view.width || i < 0 || i >= view.workers.length) return;
    const t = box.t0 + (c + 0.5) / view.width * (box.t1 - box.t0);
    const parts = PHASES.map((p, k) => `${PHASE_NAMES[p]} ${
      Math.round(100 * shares[(i * 3 + k) * view.width + c] / 255)} %`);
    const g = groups[i * view.width + c];
    tip.textContent = `worker ${view.workers[i]} at ${seconds(t)}` +
        `${g === NO_GROUP ? '' : ` · group ${g}`}\n${parts.join(' · ')}`;
  });
  root.append(hit);
}

function eventMarks(events, rowOf, x, top, rowH, plotH) {
  const g = svg('g', {class: 'events'});
  for (const e of events) {
    const style = EVENT_STYLE[e.kind];
    const many = e.count > 1 ?
      `${e.count}× (rounds ${e.round}–${e.last_round})` : `round ${e.round}`;
    const extra = e.kind === 'period' ? ` → ${e.value} steps` :
      e.kind === 'epoch_end' && e.value !== null ?
        ` (epoch ${e.value + 1}, as Keras counts)` : '';
    const text = `${style.label}${e.worker === null ? '' :
      `: worker ${e.worker}`} · ${many}${extra} at ${seconds(e.t)}`;
    const mark = svg('g', {class: `event ${e.kind}`, dataset: {
      kind: e.kind, round: e.round, count: e.count,
      worker: e.worker === null ? '' : e.worker}}, title(text));
    if (e.worker === null) {
      if (e.kind !== 'global_sync') {  // syncs are frequent: a tick only
        mark.append(svg('line', {x1: x(e.t), x2: x(e.t), y1: top,
                                 y2: top + plotH, stroke: style.colour,
                                 'stroke-dasharray': e.kind === 'period' ?
                                   '4 3' : null, class: 'event-line'}));
      }
      mark.append(svg('text', {x: x(e.t), y: top - 4, fill: style.colour,
                               'text-anchor': 'middle', class: 'glyph'},
          style.glyph));
    } else if (rowOf.has(e.worker)) {  // (a worker with no round: no row)
      const row = rowOf.get(e.worker);
      const size = Math.max(8, Math.min(14, rowH));
      mark.append(svg('text', {x: x(e.t), y: top + row * rowH + rowH / 2 +
                               size / 3, fill: style.colour,
                               'font-size': size, 'text-anchor': 'middle',
                               class: 'glyph'}, style.glyph));
    }
    g.append(mark);
  }
  return g;
}

function addZoom(root, opts, box) {
  const {t0, t1} = opts;
  const timeAt = (clientX) => {
    const r = root.getBoundingClientRect();
    const f = (clientX - r.left - box.x0) / box.plotW;
    return t0 + Math.max(0, Math.min(1, f)) * (t1 - t0);
  };
  root.addEventListener('wheel', (e) => {
    e.preventDefault();
    const span = t1 - t0;
    if (e.shiftKey || Math.abs(e.deltaX) > Math.abs(e.deltaY)) {
      const d = (e.shiftKey ? e.deltaY : e.deltaX) / box.plotW * span;
      opts.onWindow(t0 + d, t1 + d);
      return;
    }
    const at = timeAt(e.clientX);
    const f = Math.exp(Math.max(-1, Math.min(1, e.deltaY * 0.002)));
    opts.onWindow(at - (at - t0) * f, at + (t1 - at) * f);
  }, {passive: false});
  const brush = svg('rect', {class: 'brush', y: box.top, height: box.plotH,
                             width: 0, x: 0, visibility: 'hidden'});
  root.append(brush);
  let from = null;
  root.addEventListener('mousedown', (e) => {
    from = e.clientX;
    e.preventDefault();
  });
  root.addEventListener('mousemove', (e) => {
    if (from === null) return;
    const r = root.getBoundingClientRect();
    const a = Math.min(from, e.clientX) - r.left;
    brush.setAttribute('x', a);
    brush.setAttribute('width', Math.abs(e.clientX - from));
    brush.setAttribute('visibility', 'visible');
  });
  const finish = (e) => {
    if (from === null) return;
    const start = from;
    from = null;
    brush.setAttribute('visibility', 'hidden');
    if (Math.abs(e.clientX - start) > 4) {
      const a = timeAt(Math.min(start, e.clientX));
      const b = timeAt(Math.max(start, e.clientX));
      if (b > a) opts.onWindow(a, b);
    }
  };
  root.addEventListener('mouseup', finish);
  root.addEventListener('mouseleave', finish);
  root.addEventListener('dblclick', () => opts.onWindow(null));
}
