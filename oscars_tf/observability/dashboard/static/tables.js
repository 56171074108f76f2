// The workers view (per-worker totals, stragglers flagged) and the compare
// view (one row per job: where its time went, its events, its loss).

import {el, fmt, pct, seconds} from './util.js';

function breakdown(compute, wait, comm) {
  const total = compute + wait + comm || 1;
  return el('div', {className: 'bar'},
      ...[['compute', compute], ['wait', wait], ['comm', comm]].map(
          ([k, v]) => el('span', {className: k, title: `${k} ${seconds(v)}`,
                                  style: `width:${(100 * v / total)
                                      .toFixed(1)}%`})));
}

export function workersTable(job) {
  const head = el('tr', {}, ...['worker', 'steps/s', 'rounds', 'compute',
      'wait', 'communicate', 'breakdown', ''].map((h) => el('th', {}, h)));
  const rows = job.workers.map((w) => {
    const row = el('tr', {className: 'worker-row'},
        el('td', {}, `worker ${w.worker}`),
        el('td', {className: 'rate'}, fmt(w.rate, 1)),
        el('td', {}, w.rounds), el('td', {}, seconds(w.compute_s)),
        el('td', {}, seconds(w.wait_s)), el('td', {}, seconds(w.comm_s)),
        el('td', {}, breakdown(w.compute_s, w.wait_s, w.comm_s)),
        el('td', {className: 'flag'}, w.straggler ? 'straggler' : ''));
    if (w.straggler) row.classList.add('straggler');
    return row;
  });
  return el('table', {className: 'oscars-workers'}, head, ...rows);
}

const EVENT_COLUMNS = [['dropped', 'drops'], ['rejoined', 'rejoins'],
  ['poisoned', 'poisoned'], ['period', 'period changes'],
  ['global_sync', 'global syncs'], ['epoch_end', 'epochs']];

export function compareTable(jobs, summaries) {
  const head = el('tr', {}, ...['job', 'workers', 'rounds', 'wall time',
      'utilization', 'wait', 'communicate', 'breakdown', 'median steps/s',
      'final loss', ...EVENT_COLUMNS.map((c) => c[1])].map(
      (h) => el('th', {}, h)));
  const rows = summaries.map((s, k) => {
    const h = s.headline;
    return el('tr', {className: 'job-row', dataset: {job: jobs[k].id}},
        el('td', {className: 'name'}, jobs[k].name), el('td', {}, h.workers),
        el('td', {}, h.rounds), el('td', {}, seconds(h.duration_s)),
        el('td', {}, pct(h.utilization)), el('td', {}, pct(h.wait_share)),
        el('td', {}, pct(h.comm_share)),
        el('td', {}, breakdown(h.utilization || 0, h.wait_share || 0,
            h.comm_share || 0)),
        el('td', {}, fmt(h.median_rate, 1)),
        el('td', {}, fmt(h.final_loss, 3)),
        ...EVENT_COLUMNS.map(([k]) => el('td', {}, h.events[k])));
  });
  return el('table', {className: 'oscars-compare'}, head, ...rows);
}
