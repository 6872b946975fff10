// Building blocks of the console's pages: elements from values (never from HTML strings),
// tables whose rows are rebuilt only when their object changed, buttons that act through
// the API, and a job's steps drawn as a graph.

import { api, keyOf, liveOf } from './api.js';

export const JOB_LABEL = 'propeller.propeller.absmach.eu/job';
export const SPEC_NAME = 'propeller.propeller.absmach.eu/spec-name';
export const ROW_LIMIT = 500;
const SVG_NS = 'http://www.w3.org/2000/svg';

/** An element with attributes (`on*` become listeners) and children (strings become text). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith('on')) el.addEventListener(name.slice(2), value);
    else if (name === 'class') el.className = value;
    else el.setAttribute(name, value === true ? '' : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs)) el.setAttribute(name, String(value));
  for (const child of children) el.append(child instanceof Node ? child : String(child));
  return el;
}

export function ago(time) {
  if (!time) return '—';
  const seconds = Math.round((Date.now() - Date.parse(time)) / 1000);
  if (seconds < 60) return `${Math.max(seconds, 0)} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.round(seconds / 3600)} h ago`;
  return `${Math.round(seconds / 86400)} d ago`;
}

export const phaseOf = (o) => String(o?.status?.phase || 'Pending');
export const badge = (phase) => h('span', { class: `phase phase-${phase.toLowerCase()}` }, phase);
export const labelsOf = (o) => Object.entries(o.metadata?.labels || {}).map(([k, v]) => `${k}=${v}`);
export const link = (href, text) => h('a', { href }, text);
export const objectHref = (kind, o) => `#/${kind}/${encodeURIComponent(o.metadata.namespace)}/${encodeURIComponent(o.metadata.name)}`;

/**
 * Rows kept between repaints: a row is built again only when its object changed (or its
 * "ago" columns are 5 s older), so a large fleet repaints cheaply.
 */
export class RowCache {
  constructor() {
    this.rows = new Map();
  }

  /** The row of object `o`, built by `build(o)` when it is new or changed. */
  row(o, build) {
    const key = keyOf(o);
    const version = `${o.metadata?.resourceVersion}|${Math.floor(Date.now() / 5000)}`;
    const kept = this.rows.get(key);
    if (kept && kept.version === version) {
      kept.used = true;
      return kept.row;
    }
    const row = build(o);
    this.rows.set(key, { version, row, used: true });
    return row;
  }

  /** Forgets the rows not asked for since the last call. */
  prune() {
    for (const [key, kept] of this.rows) {
      if (!kept.used) this.rows.delete(key);
      kept.used = false;
    }
  }
}

/** What the fleet filter matches, worked out once per version of an object. */
const searchTexts = new WeakMap();
export function searchText(p) {
  let text = searchTexts.get(p);
  if (text === undefined) {
    text = [p.metadata.name, p.metadata.namespace, phaseOf(p), p.status?.metadata?.propletVersion || '', ...labelsOf(p)].join(' ').toLowerCase();
    searchTexts.set(p, text);
  }
  return text;
}

export const byKey = (a, b) => {
  const [x, y] = [keyOf(a), keyOf(b)];
  return x < y ? -1 : x > y ? 1 : 0;
};

export function table(headers, rows, empty = 'Nothing yet.') {
  if (!rows.length) return h('p', { class: 'empty' }, empty);
  return h('table', {}, h('thead', {}, h('tr', {}, headers.map((t) => h('th', {}, t)))), h('tbody', {}, rows));
}

export function conditionsTable(o) {
  const rows = (o.status?.conditions || []).map((c) =>
    h('tr', {}, h('td', {}, c.type), h('td', {}, c.status), h('td', {}, c.reason || ''), h('td', {}, c.message || ''), h('td', {}, ago(c.lastTransitionTime))),
  );
  return table(['Type', 'Status', 'Reason', 'Message', 'Changed'], rows, 'No conditions yet.');
}

export function statusLine(kinds) {
  const errors = kinds.map((k) => liveOf(k).error).filter(Boolean);
  if (errors.length) return h('p', { class: 'error' }, `Reconnecting: ${errors[0]}`);
  if (kinds.some((k) => !liveOf(k).synced)) return h('p', { class: 'muted' }, 'Loading…');
  return null;
}

/** Loads an object's recent Events into `box` once. */
export function eventsInto(box, kind, o) {
  api('GET', `/v1/events/${kind}/${encodeURIComponent(o.metadata.namespace)}/${encodeURIComponent(o.metadata.name)}`)
    .then((events) => {
      const rows = (events || []).map((e) => h('tr', {}, h('td', {}, e.type), h('td', {}, e.reason), h('td', {}, e.message), h('td', {}, ago(e.time))));
      box.replaceChildren(table(['Type', 'Reason', 'Message', 'When'], rows, 'No recent events.'));
    })
    .catch((e) => box.replaceChildren(h('p', { class: 'error' }, e.message)));
}

/** A Delete button that asks once more, then shows the API's answer in `out`. */
export function deleteButton(kind, o, out, after) {
  const button = h('button', { type: 'button', class: 'danger', 'data-action': 'delete' }, 'Delete');
  let armed = false;
  button.addEventListener('click', async () => {
    if (!armed) {
      armed = true;
      button.textContent = `Delete ${o.metadata.name}?`;
      return;
    }
    button.disabled = true;
    try {
      const done = await api('DELETE', `/v1/objects/${kind}/${encodeURIComponent(o.metadata.namespace)}/${encodeURIComponent(o.metadata.name)}`);
      out.replaceChildren(h('p', { class: 'ok' }, `${done.kind} ${done.namespace}/${done.name}: ${done.outcome}`));
      if (after) after();
    } catch (e) {
      out.replaceChildren(h('p', { class: 'error' }, e.message));
      button.disabled = false;
    }
  });
  return button;
}

/** A Rerun button: the same spec applied under a new name. */
export function rerunButton(o, out) {
  return h('button', {
    type: 'button',
    'data-action': 'rerun',
    onclick: async () => {
      const suffix = `-rerun-${Date.now().toString(36)}`;
      const name = o.metadata.name.slice(0, 63 - suffix.length) + suffix;
      const labels = { ...(o.metadata.labels || {}) };
      delete labels[JOB_LABEL];
      const copy = { apiVersion: o.apiVersion, kind: o.kind, metadata: { name, namespace: o.metadata.namespace, labels }, spec: o.spec };
      try {
        await api('POST', '/v1/apply', JSON.stringify(copy), 'application/json');
        location.hash = objectHref(o.kind.toLowerCase(), copy);
      } catch (e) {
        out.replaceChildren(h('p', { class: 'error' }, e.message));
      }
    },
  }, 'Rerun');
}

export function specBlock(o) {
  const spec = JSON.parse(JSON.stringify(o.spec || {}));
  const shorten = (s) => (typeof s.file === 'string' && s.file.length > 80 ? { ...s, file: `${s.file.slice(0, 60)}… (${s.file.length} base64 characters)` } : s);
  const shown = Array.isArray(spec.tasks) ? { ...spec, tasks: spec.tasks.map(shorten) } : shorten(spec);
  return h('pre', { class: 'spec' }, JSON.stringify(shown, null, 2));
}

export function taskRow(t) {
  const s = t.status || {};
  return h('tr', { 'data-name': t.metadata.name, 'data-phase': phaseOf(t) },
    h('td', {}, link(objectHref('task', t), t.metadata.name)),
    h('td', {}, t.metadata.namespace),
    h('td', {}, badge(phaseOf(t))),
    h('td', {}, s.assignedProplet || '—'),
    h('td', {}, s.results ?? s.error ?? '—'),
    h('td', {}, ago(s.startedAt)),
    h('td', {}, ago(s.finishedAt)),
  );
}

export function taskTable(tasks, cache) {
  const rows = tasks.map((t) => cache.row(t, taskRow));
  cache.prune();
  return table(['Name', 'Namespace', 'Phase', 'Proplet', 'Result', 'Started', 'Finished'], rows, 'No tasks.');
}

/** A job's steps as a left-to-right graph: a column per depth, an edge per dependency. */
export function dag(specs, tasks, namespace) {
  const depth = new Map();
  const byName = new Map(specs.map((s) => [s.name, s]));
  const depthOf = (name, seen = new Set()) => {
    if (depth.has(name)) return depth.get(name);
    if (seen.has(name)) return 0;
    seen.add(name);
    const parents = (byName.get(name)?.dependsOn || []).filter((p) => byName.has(p));
    const d = parents.length ? 1 + Math.max(...parents.map((p) => depthOf(p, seen))) : 0;
    depth.set(name, d);
    return d;
  };
  const columns = [];
  for (const s of specs) (columns[depthOf(s.name)] ||= []).push(s.name);
  const [w, hgt, gapX, gapY] = [170, 48, 70, 24];
  const at = new Map();
  columns.forEach((names, c) => names.forEach((n, r) => at.set(n, { x: 10 + c * (w + gapX), y: 10 + r * (hgt + gapY) })));
  const width = 20 + columns.length * (w + gapX) - gapX;
  const height = 20 + Math.max(1, ...columns.map((c) => c.length)) * (hgt + gapY) - gapY;
  const root = svg('svg', { width, height, viewBox: `0 0 ${width} ${height}`, role: 'img', 'aria-label': 'job steps' });
  for (const s of specs) {
    for (const p of s.dependsOn || []) {
      const [a, b] = [at.get(p), at.get(s.name)];
      if (!a || !b) continue;
      const [x1, y1, x2, y2] = [a.x + w, a.y + hgt / 2, b.x, b.y + hgt / 2];
      root.append(svg('path', { class: 'edge', d: `M${x1},${y1} C${x1 + gapX / 2},${y1} ${x2 - gapX / 2},${y2} ${x2},${y2}` }));
    }
  }
  for (const s of specs) {
    const { x, y } = at.get(s.name);
    const task = tasks.get(s.name);
    const phase = task ? phaseOf(task).toLowerCase() : 'waiting';
    const node = svg('g', { class: `node phase-${phase}`, 'data-step': s.name, 'data-phase': phase, transform: `translate(${x},${y})` },
      svg('rect', { width: w, height: hgt, rx: 6 }),
      svg('text', { x: 10, y: 20, class: 'step' }, s.name),
      svg('text', { x: 10, y: 38, class: 'state' }, task?.status?.results !== undefined ? `${phase} → ${task.status.results}` : phase),
    );
    if (task) {
      const a = svg('a', { href: `#/task/${encodeURIComponent(namespace)}/${encodeURIComponent(task.metadata.name)}` });
      a.append(node);
      root.append(a);
    } else root.append(node);
  }
  return root;
}
