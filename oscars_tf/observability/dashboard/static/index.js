// The `oscars` TensorBoard dashboard: plain DOM, no build step.
// TensorBoard loads this module in the plugin's iframe and calls render();
// relative URLs resolve to /data/plugin/oscars/.

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, attrs);
  for (const child of children) {
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function heat(value, max) {
  // Slow = dark red, fast = pale: the eye finds stragglers at once.
  const t = max > 0 ? Math.max(0, Math.min(1, value / max)) : 0;
  return `hsl(${Math.round(120 * t)}, 70%, ${Math.round(35 + 40 * t)}%)`;
}

function fmt(x, digits = 2) {
  return Number.isFinite(x) ? x.toFixed(digits) : '–';
}

function workersTable(workers) {
  const head = el('tr', {}, ...['worker', 'steps/s', 'rounds', 'compute s',
      'wait s', 'communicate s', 'breakdown', ''].map((h) => el('th', {}, h)));
  const rows = workers.map((w) => {
    const total = w.compute_s + w.wait_s + w.comm_s || 1;
    const bar = el('div', {className: 'bar'},
        ...[['compute', w.compute_s], ['wait', w.wait_s],
            ['comm', w.comm_s]].map(([k, v]) => el('span', {
          className: k, title: `${k} ${fmt(v)} s`,
          style: `width:${(100 * v / total).toFixed(1)}%`})));
    const row = el('tr', {className: 'worker-row'},
        el('td', {}, `worker ${w.worker}`), el('td', {className: 'rate'},
            fmt(w.rate, 1)), el('td', {}, w.rounds), el('td', {},
            fmt(w.compute_s)), el('td', {}, fmt(w.wait_s)),
        el('td', {}, fmt(w.comm_s)), el('td', {}, bar),
        el('td', {className: 'flag'}, w.straggler ? 'straggler' : ''));
    if (w.straggler) row.classList.add('straggler');
    return row;
  });
  return el('table', {id: 'oscars-workers'}, head, ...rows);
}

function roundGrid(id, title, rows, cell) {
  // rows: [{label, points: [[round, value], ...]}]; one column per round.
  const rounds = [...new Set(rows.flatMap((r) => r.points.map((p) => p[0])))]
      .sort((a, b) => a - b);
  const max = Math.max(0, ...rows.flatMap((r) => r.points.map((p) => p[1])));
  const head = el('tr', {}, el('th', {}, 'round →'),
      ...rounds.map((k) => el('th', {}, k)));
  const body = rows.map((r) => {
    const at = new Map(r.points);
    return el('tr', {}, el('th', {}, r.label), ...rounds.map((k) => {
      const v = at.get(k);
      return v === undefined ? el('td') : cell(v, max);
    }));
  });
  return el('section', {}, el('h3', {}, title),
      el('table', {id, className: 'grid'}, head, ...body));
}

async function showJob(name, target) {
  const response = await fetch(`./job?name=${encodeURIComponent(name)}`);
  const job = await response.json();
  target.replaceChildren(
      el('h2', {}, `job ${name}`), workersTable(job.workers),
      roundGrid('oscars-heatmap', 'step-rate table (steps/s, worker × round)',
          job.table.map((t) => ({label: `worker ${t.worker}`,
                                 points: t.rates})),
          (v, max) => el('td', {title: fmt(v, 1),
                                style: `background:${heat(v, max)}`},
              fmt(v, 0))),
      roundGrid('oscars-groups', 'groups (lowest member of each group)',
          job.workers.map((w) => ({label: `worker ${w.worker}`,
                                   points: w.series.group || []})),
          (v) => el('td', {className: `group g${v % 6}`}, v)));
}

export async function render() {
  document.head.append(el('style', {textContent: `
    body { font: 13px sans-serif; margin: 16px; }
    table { border-collapse: collapse; margin: 8px 0 20px; }
    th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: right; }
    .bar { display: flex; width: 240px; height: 12px; }
    .bar span { display: block; height: 100%; }
    .compute { background: #4caf50; } .wait { background: #f44336; }
    .comm { background: #2196f3; }
    tr.straggler td { background: #ffebee; } .flag { color: #c62828; }
    .g0 { background: #e3f2fd; } .g1 { background: #fff3e0; }
    .g2 { background: #e8f5e9; } .g3 { background: #f3e5f5; }
    .g4 { background: #fffde7; } .g5 { background: #e0f7fa; }`}));
  const jobs = (await (await fetch('./jobs')).json()).jobs;
  const content = el('div', {id: 'oscars-job'});
  const picker = el('select', {id: 'oscars-jobs'},
      ...jobs.map((j) => el('option', {value: j}, j)));
  picker.addEventListener('change', () => showJob(picker.value, content));
  document.body.append(el('h1', {}, 'Oscars'),
      jobs.length ? picker : el('p', {}, 'No oscars_tf runs in this logdir.'),
      content);
  if (jobs.length) await showJob(jobs[0], content);
}
