// The `oscars` TensorBoard dashboard: "where did my time go?" for 4 or 400
// workers. Plain ES modules and SVG/canvas, no build step, no network
// beyond this plugin's own routes. TensorBoard loads this module in the
// plugin's iframe and calls render(); relative URLs resolve to
// /data/plugin/oscars/ (the backend: plugin.py).
//
// Views (tabs), each for the jobs ticked in the job list, on one time axis
// (seconds since each job's start) so jobs compare side by side:
//   timeline  each worker's rounds (compute / wait / communicate) and the
//             events; zoom with the wheel or by dragging, double-click out
//   charts    step rate, T, period, divergence, loss, utilization
//   workers   per-worker totals, stragglers flagged
//   compare   one row per job: utilization, waits, events, loss

import {renderCharts} from './static/charts.js';
import {compareTable, workersTable} from './static/tables.js';
import {renderTimeline, timelineLegend} from './static/timeline.js';
import {el, getJson, seconds} from './static/util.js';

const VIEWS = ['timeline', 'charts', 'workers', 'compare'];
const STYLE = `
  body { font: 13px sans-serif; margin: 16px; color: #212121; }
  h1 { font-size: 20px; margin: 0 0 8px; }
  h3 { font-size: 14px; margin: 14px 0 4px; }
  .bar-row { display: flex; gap: 16px; align-items: center; flex-wrap: wrap;
             margin: 6px 0; }
  .tabs button { font: inherit; padding: 4px 12px; border: 1px solid #bbb;
                 background: #fafafa; cursor: pointer; }
  .tabs button.active { background: #1e88e5; color: white;
                        border-color: #1e88e5; }
  .jobs label { margin-right: 12px; white-space: nowrap; }
  .note { color: #8d6e63; }
  .legend { display: flex; flex-wrap: wrap; gap: 4px 14px; margin: 4px 0; }
  .legend .key i { display: inline-block; width: 12px; height: 10px;
                   margin-right: 4px; vertical-align: middle; }
  .legend .key b { margin-right: 4px; }
  .timeline-wrap { position: relative; user-select: none; }
  .timeline-wrap > svg, .timeline-wrap > canvas { position: absolute;
                                                  left: 0; top: 0; }
  canvas.binned { image-rendering: pixelated; }
  svg text { font: 11px sans-serif; fill: #424242; }
  svg .grid { stroke: #eee; }
  svg .event-line { stroke-width: 1.2; opacity: 0.75; }
  svg .glyph { font-weight: bold; }
  svg .brush { fill: rgba(30, 136, 229, 0.15); stroke: #1e88e5; }
  svg .empty { fill: #9e9e9e; }
  .charts { display: grid; gap: 4px 12px; }
  figure.chart { margin: 0; }
  figcaption { font-weight: bold; font-size: 12px; }
  table { border-collapse: collapse; margin: 8px 0 20px; }
  th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: right; }
  td.name { text-align: left; font-weight: bold; }
  .bar { display: flex; width: 200px; height: 12px; }
  .bar span { display: block; height: 100%; }
  .compute { background: #43a047; } .wait { background: #e53935; }
  .comm { background: #1e88e5; }
  tr.straggler td { background: #ffebee; } .flag { color: #c62828; }
  .error { color: #c62828; }`;

const state = {jobs: [], selected: [], view: 'timeline', window: null,
               colourBy: 'phase', durations: {}};
let content;
let shown = 0;  // the latest render wins
let renders = 0;  // finished renders (data-renders: tests wait on it)
let pending = null;

function query(job, extra = {}) {
  const params = new URLSearchParams({name: job.id, ...extra});
  return params.toString();
}

function fullWindow() {
  const d = Math.max(1e-3, ...state.selected.map(
      (j) => state.durations[j.id] || 0));
  return [0, d];
}

function setWindow(t0, t1) {
  if (t0 === null || t0 === undefined) {
    state.window = null;
  } else {
    const [lo, hi] = fullWindow();
    const span = Math.max(1e-4, Math.min(hi - lo, t1 - t0));
    let a = Math.max(lo, t0);
    if (a + span > hi) a = hi - span;
    state.window = [a, a + span];
  }
  clearTimeout(pending);
  pending = setTimeout(show, 80);  // one fetch per burst of wheel events
}

async function showTimeline(width) {
  const [t0, t1] = state.window || fullWindow();
  const views = await Promise.all(state.selected.map((j) => getJson(
      `./timeline?${query(j, {t0, t1, width: width - 98})}`)));
  views.forEach((v, k) => {
    state.durations[state.selected[k].id] = v.duration;
  });
  const groups = [...new Set(views.flatMap((v) => v.groups))].sort(
      (a, b) => a - b);
  const colour = el('select', {id: 'oscars-colour-by'},
      el('option', {value: 'phase'}, 'colour: phase'),
      el('option', {value: 'group'}, 'colour: group'));
  colour.value = state.colourBy;
  colour.addEventListener('change', () => {
    state.colourBy = colour.value;
    show();
  });
  const out = el('button', {id: 'oscars-zoom-out'}, 'zoom out');
  out.addEventListener('click', () => setWindow(null));
  const parts = [el('div', {className: 'bar-row'}, colour, out,
      el('span', {className: 'window'},
          `${seconds(t0)} – ${seconds(t1)} · wheel or drag to zoom, ` +
          'shift+wheel to pan, double-click to zoom out'))];
  parts.push(timelineLegend(state.colourBy, groups));
  views.forEach((v, k) => {
    const job = state.selected[k];
    parts.push(el('section', {className: 'job-panel', dataset: {
      job: job.id}}, el('h3', {}, `${job.name} — ${v.workers.length} ` +
        `workers, ${v.rounds} rounds, ${v.mode === 'exact' ?
          `${v.segments} worker-rounds` : `binned in ${v.width} columns`}`),
    sampledNote(v), renderTimeline(v, {
      t0, t1, width, colourBy: state.colourBy, onWindow: setWindow})));
  });
  return parts;
}

function sampledNote(v) {
  return v.sampled ? el('p', {className: 'note'}, 'TensorBoard kept a ' +
      'sample of the rounds: start it with --samples_per_plugin=' +
      'scalars=0 to see every round.') : null;
}

async function showCharts(width) {
  const [t0, t1] = state.window || fullWindow();
  const each = Math.floor(width / state.selected.length);
  const views = await Promise.all(state.selected.map((j) => getJson(
      `./charts?${query(j, {t0, t1, width: Math.max(100, each - 60)})}`)));
  const counts = state.selected.map((j) => j.workers);
  return [el('p', {}, `${seconds(t0)} – ${seconds(t1)} (the timeline's ` +
      'window); one colour per worker'), renderCharts(views, state.selected,
      {t0, t1, width, workerCounts: counts})];
}

async function showWorkers() {
  const jobs = await Promise.all(state.selected.map(
      (j) => getJson(`./job?${query(j)}`)));
  return jobs.flatMap((job, k) => [el('section', {className: 'job-panel',
      dataset: {job: state.selected[k].id}},
  el('h3', {}, state.selected[k].name), sampledNote(job),
  workersTable(job))]);
}

async function showCompare() {
  const jobs = await Promise.all(state.selected.map(
      (j) => getJson(`./job?${query(j)}`)));
  // Counted from the rounds TensorBoard kept: said once, as on the others.
  const note = jobs.map(sampledNote).find((n) => n);
  return note ? [note, compareTable(state.selected, jobs)] :
    [compareTable(state.selected, jobs)];
}

// Every ticked job's length, for the shared time axis.
async function knowDurations() {
  const unknown = state.selected.filter((j) => !(j.id in state.durations));
  const found = await Promise.all(unknown.map(
      (j) => getJson(`./job?${query(j)}`)));
  found.forEach((s, k) => {
    state.durations[unknown[k].id] = s.headline.duration_s;
  });
}

async function show() {
  const mine = ++shown;
  content.dataset.view = state.view;
  content.dataset.state = 'loading';
  const width = Math.max(480, content.clientWidth || 1000);
  try {
    await knowDurations();
    const parts = state.selected.length === 0 ?
      [el('p', {}, 'Tick a job above.')] :
      await {timeline: showTimeline, charts: showCharts,
             workers: showWorkers, compare: showCompare}[state.view](width);
    if (mine !== shown) return;
    content.replaceChildren(...parts.filter((p) => p));
    content.dataset.state = 'ready';
    content.dataset.renders = String(++renders);
  } catch (e) {
    if (mine !== shown) return;
    content.replaceChildren(el('p', {className: 'error'}, String(e)));
    content.dataset.state = 'error';
    console.error('oscars dashboard:', e);
  }
}

function picker() {
  const boxes = state.jobs.map((job, k) => {
    const box = el('input', {type: 'checkbox', value: job.id,
                             checked: k < 4});
    box.addEventListener('change', () => {
      state.selected = state.jobs.filter((j, i) => boxes[i].checked);
      show();
    });
    return box;
  });
  return el('div', {className: 'jobs', id: 'oscars-jobs'},
      el('b', {}, 'jobs: '), ...state.jobs.map((job, k) => el('label', {
        title: job.id === '.' ? 'the log directory itself' : job.id},
      boxes[k], ` ${job.name} (${job.workers})`)));
}

function tabs() {
  const buttons = VIEWS.map((v) => {
    const b = el('button', {dataset: {view: v}, className: v === state.view ?
      'active' : ''}, v);
    b.addEventListener('click', () => {
      state.view = v;
      buttons.forEach((x) => x.classList.toggle('active', x === b));
      show();
    });
    return b;
  });
  return el('div', {className: 'tabs', id: 'oscars-tabs'}, ...buttons);
}

export async function render() {
  document.head.append(el('style', {textContent: STYLE}));
  state.jobs = (await getJson('./jobs')).jobs;
  state.selected = state.jobs.slice(0, 4);
  content = el('div', {id: 'oscars-view'});
  document.body.append(el('h1', {}, 'Oscars'));
  if (!state.jobs.length) {
    document.body.append(el('p', {}, 'No oscars_tf runs in this logdir.'));
    return;
  }
  document.body.append(picker(), el('div', {className: 'bar-row'}, tabs()),
      content);
  await show();
}
