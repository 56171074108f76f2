// The charts view: per-round series over wall time, one small SVG chart per
// series and job; jobs side by side share each chart's axes, so strategies
// compare at a glance. The x axis is the timeline's window.

import {el, fmt, seconds, svg, ticks, title, workerColour} from './util.js';

const PAD = {left: 52, right: 10, top: 8, bottom: 22};
const BAND = {highest: '#ef6c00', median: '#263238', lowest: '#1e88e5'};

function lineColour(line, workers) {
  if (line.label) return BAND[line.label];
  return line.worker === null ? '#37474f' :
    workerColour(line.worker, workers);
}

// Rows of [chart id, chart title]; each job's /charts answer in `views`.
// Returns an element with a row per chart and a column per job.
export function renderCharts(views, jobs, opts) {
  const ids = views[0].charts.map((c) => [c.id, c.title]);
  const grid = el('div', {className: 'charts',
                          style: `grid-template-columns: repeat(${
                            views.length}, 1fr)`});
  grid.append(...views.map((v, k) => chartLegend(v, opts.workerCounts[k])));
  const width = Math.max(260, Math.floor(
      (opts.width - 12 * (views.length - 1)) / views.length));
  for (const [id, name] of ids) {
    const charts = views.map((v) => v.charts.find((c) => c.id === id));
    // One y range per series across jobs (a loop: 400 lines x 600 points
    // are too many arguments for Math.max).
    let lo = 0;
    let hi = -Infinity;
    for (const c of charts) {
      for (const l of c.lines) {
        for (const p of l.points) {
          if (p[1] < lo) lo = p[1];
          if (p[1] > hi) hi = p[1];
        }
      }
    }
    if (!(hi > lo)) hi = lo + 1;
    charts.forEach((chart, k) => {
      grid.append(el('figure', {className: 'chart'},
          el('figcaption', {}, `${name}${views.length > 1 ?
            ` — ${jobs[k].name}` : ''}`),
          lineChart(chart, {width, height: 150, t0: opts.t0, t1: opts.t1,
                            lo, hi, workers: opts.workerCounts[k],
                            job: jobs[k].id})));
    });
  }
  return grid;
}

// Which colour is which worker (or, past 16 workers, which line is which).
function chartLegend(view, workers) {
  const rate = view.charts.find((c) => c.id === 'rate') || view.charts[0];
  const keys = rate.lines.map((l) => [l.label || `worker ${l.worker}`,
    lineColour(l, workers)]);
  return el('div', {className: 'legend'}, ...keys.map(([name, colour]) =>
    el('span', {className: 'key'}, el('i', {style: `background:${colour}`}),
        name)));
}

function lineChart(chart, o) {
  const plotW = o.width - PAD.left - PAD.right;
  const plotH = o.height - PAD.top - PAD.bottom;
  const x = (t) => PAD.left + (t - o.t0) / (o.t1 - o.t0) * plotW;
  const y = (v) => PAD.top + plotH - (v - o.lo) / (o.hi - o.lo) * plotH;
  const points = chart.lines.reduce((a, l) => a + l.points.length, 0);
  const root = svg('svg', {class: 'oscars-chart', width: o.width,
                           height: o.height, dataset: {
                             chart: chart.id, job: o.job,
                             lines: chart.lines.length, points}});
  const axis = svg('g', {class: 'axis'});
  for (const t of ticks(o.t0, o.t1, Math.max(2, Math.round(plotW / 90)))) {
    axis.append(svg('line', {x1: x(t), x2: x(t), y1: PAD.top,
                             y2: PAD.top + plotH, class: 'grid'}),
        svg('text', {x: x(t), y: o.height - 6, 'text-anchor': 'middle'},
            seconds(t)));
  }
  for (const v of ticks(o.lo, o.hi, 4)) {
    axis.append(svg('line', {x1: PAD.left, x2: PAD.left + plotW, y1: y(v),
                             y2: y(v), class: 'grid'}),
        svg('text', {x: PAD.left - 4, y: y(v) + 4, 'text-anchor': 'end'},
            Math.abs(v) >= 100 ? v.toFixed(0) : fmt(v, Math.abs(v) < 1 ?
              3 : 1)));
  }
  root.append(axis);
  root.append(svg('clipPath', {id: `clip-${chart.id}-${clipCount}`},
      svg('rect', {x: PAD.left, y: PAD.top - 2, width: plotW,
                   height: plotH + 4})));
  const lines = svg('g', {'clip-path': `url(#clip-${chart.id}-${
    clipCount++})`});
  for (const line of chart.lines) {
    const colour = lineColour(line, o.workers);
    // A path with a gap where the worker missed rounds (dropped).
    const breaks = new Set(line.breaks || []);
    const d = line.points.map((p, i) => `${i === 0 || breaks.has(i) ?
      'M' : 'L'}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join('');
    const last = line.points[line.points.length - 1];
    lines.append(svg('path', {
      class: 'line', d, stroke: colour, fill: 'none',
      'stroke-width': o.workers > 20 ? 0.7 : 1.5, dataset: {
        worker: line.worker === null ? '' : line.worker,
        points: line.points.length}},
    title(`${line.label || (line.worker === null ? 'cluster' :
      `worker ${line.worker}`)}` +
          `${last ? `: ${fmt(last[1], 3)} at ${seconds(last[0])}` : ''}`)));
  }
  root.append(lines);
  if (!points) {
    root.append(svg('text', {x: PAD.left + plotW / 2, y: PAD.top + plotH / 2,
                             'text-anchor': 'middle', class: 'empty'},
        'no data in this window'));
  }
  return root;
}

let clipCount = 0;
