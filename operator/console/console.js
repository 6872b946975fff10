// Propeller's web console: one page over propeller's HTTP API (`/v1/...`), kept live by its
// watch streams. The bearer token stays in this tab's sessionStorage and goes only in the
// Authorization header of requests to this origin. No HTML is built from strings: every
// value reaches the page as text nodes or attributes.

const TOKEN_KEY = 'propeller-console-token';
const NAMESPACE_KEY = 'propeller-console-namespace';
const JOB_LABEL = 'propeller.propeller.absmach.eu/job';
const SPEC_NAME = 'propeller.propeller.absmach.eu/spec-name';
const INITIAL_EVENTS_END = 'k8s.io/initial-events-end';
const ROW_LIMIT = 500;
const SVG_NS = 'http://www.w3.org/2000/svg';

/** Counts what the page was sent, for `scripts/bench-console.sh`. */
const stats = { watchCharacters: 0 };
window.propellerConsoleStats = stats;

const token = () => sessionStorage.getItem(TOKEN_KEY) || '';
const namespace = () => sessionStorage.getItem(NAMESPACE_KEY) || '';
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const keyOf = (o) => `${o.metadata?.namespace || ''}/${o.metadata?.name || ''}`;

/** An element with attributes (`on*` become listeners) and children (strings become text). */
function h(tag, attrs = {}, ...children) {
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

function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs)) el.setAttribute(name, String(value));
  for (const child of children) el.append(child instanceof Node ? child : String(child));
  return el;
}

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function errorOf(res) {
  const text = await res.text();
  try {
    return new ApiError(res.status, JSON.parse(text).error || text);
  } catch {
    return new ApiError(res.status, text || res.statusText);
  }
}

/** Calls the API; the parsed JSON (or text), or an ApiError with the API's own message. */
async function api(method, path, body, contentType = 'application/yaml') {
  const headers = { Authorization: `Bearer ${token()}` };
  if (body !== undefined) headers['Content-Type'] = contentType;
  const res = await fetch(path, { method, headers, body, cache: 'no-store' });
  if (!res.ok) {
    const error = await errorOf(res);
    // A token that stopped working (expired, rotated) ends the session; the sign-in form
    // shows its own refusals.
    if (res.status === 401 && current) signOut(error.message);
    throw error;
  }
  const type = res.headers.get('content-type') || '';
  return type.startsWith('application/json') ? res.json() : res.text();
}

/** Every object of one kind, kept current by a watch that resumes where it broke off. */
class Live {
  constructor(kind) {
    this.kind = kind;
    this.items = new Map();
    this.synced = false;
    this.error = '';
    this.version = '';
    /** Grows with every change, so views redo sorting only when something changed. */
    this.generation = 0;
    this.listeners = new Set();
    this.abort = null;
  }

  subscribe(listener) {
    this.listeners.add(listener);
    if (!this.abort) this.run();
    return () => this.listeners.delete(listener);
  }

  stop() {
    if (this.abort) this.abort.abort();
    this.abort = null;
  }

  changed() {
    for (const listener of this.listeners) listener();
  }

  async run() {
    const abort = new AbortController();
    this.abort = abort;
    while (!abort.signal.aborted) {
      // Without a version the stream starts with every object, then a bookmark: objects not
      // named before it are gone.
      let stale = this.version ? null : new Set(this.items.keys());
      let pending = '';
      try {
        const query = new URLSearchParams();
        if (namespace()) query.set('namespace', namespace());
        if (this.version) query.set('resourceVersion', this.version);
        const res = await fetch(`/v1/watch/${this.kind}?${query}`, {
          headers: { Authorization: `Bearer ${token()}` },
          signal: abort.signal,
          cache: 'no-store',
        });
        if (!res.ok) {
          const error = await errorOf(res);
          if (res.status === 401) return signOut(error.message);
          throw error;
        }
        const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = '';
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value;
          stats.watchCharacters += value.length;
          let end;
          while ((end = buffer.indexOf('\n')) >= 0) {
            const line = buffer.slice(0, end).trim();
            buffer = buffer.slice(end + 1);
            if (!line) continue;
            const event = JSON.parse(line);
            const meta = event.object?.metadata || {};
            if (event.type === 'ADDED' || event.type === 'MODIFIED') {
              this.items.set(keyOf(event.object), event.object);
              stale?.delete(keyOf(event.object));
              pending = meta.resourceVersion || pending;
            } else if (event.type === 'DELETED') {
              this.items.delete(keyOf(event.object));
              pending = meta.resourceVersion || pending;
            } else if (event.type === 'BOOKMARK') {
              pending = meta.resourceVersion || pending;
              if (meta.annotations?.[INITIAL_EVENTS_END]) {
                for (const key of stale || []) this.items.delete(key);
                stale = null;
                this.synced = true;
              }
            } else if (event.type === 'ERROR') {
              // 410: the version is too old to resume from; start over.
              this.version = '';
              pending = '';
              if (event.object?.code !== 410) throw new Error(event.object?.message || 'watch error');
              break;
            }
            // A version is safe to resume from once the initial objects have all arrived.
            if (!stale && pending) this.version = pending;
            this.generation += 1;
            this.error = '';
            this.changed();
          }
        }
      } catch (e) {
        if (abort.signal.aborted) return;
        this.error = e.message || String(e);
        this.changed();
        await sleep(2000);
      }
    }
  }
}

const live = {};
const liveOf = (kind) => (live[kind] ||= new Live(kind));

// ---- small renderers ----

function ago(time) {
  if (!time) return '—';
  const seconds = Math.round((Date.now() - Date.parse(time)) / 1000);
  if (seconds < 60) return `${Math.max(seconds, 0)} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.round(seconds / 3600)} h ago`;
  return `${Math.round(seconds / 86400)} d ago`;
}

const phaseOf = (o) => String(o?.status?.phase || 'Pending');
const badge = (phase) => h('span', { class: `phase phase-${phase.toLowerCase()}` }, phase);
const labelsOf = (o) => Object.entries(o.metadata?.labels || {}).map(([k, v]) => `${k}=${v}`);
const link = (href, text) => h('a', { href }, text);
const objectHref = (kind, o) => `#/${kind}/${encodeURIComponent(o.metadata.namespace)}/${encodeURIComponent(o.metadata.name)}`;

/**
 * Rows kept between repaints: a row is built again only when its object changed (or its
 * "ago" columns are 5 s older), so a large fleet repaints cheaply.
 */
class RowCache {
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
function searchText(p) {
  let text = searchTexts.get(p);
  if (text === undefined) {
    text = [p.metadata.name, p.metadata.namespace, phaseOf(p), p.status?.metadata?.propletVersion || '', ...labelsOf(p)].join(' ').toLowerCase();
    searchTexts.set(p, text);
  }
  return text;
}

const byKey = (a, b) => {
  const [x, y] = [keyOf(a), keyOf(b)];
  return x < y ? -1 : x > y ? 1 : 0;
};

function table(headers, rows, empty = 'Nothing yet.') {
  if (!rows.length) return h('p', { class: 'empty' }, empty);
  return h('table', {}, h('thead', {}, h('tr', {}, headers.map((t) => h('th', {}, t)))), h('tbody', {}, rows));
}

function conditionsTable(o) {
  const rows = (o.status?.conditions || []).map((c) =>
    h('tr', {}, h('td', {}, c.type), h('td', {}, c.status), h('td', {}, c.reason || ''), h('td', {}, c.message || ''), h('td', {}, ago(c.lastTransitionTime))),
  );
  return table(['Type', 'Status', 'Reason', 'Message', 'Changed'], rows, 'No conditions yet.');
}

function statusLine(kinds) {
  const errors = kinds.map((k) => liveOf(k).error).filter(Boolean);
  if (errors.length) return h('p', { class: 'error' }, `Reconnecting: ${errors[0]}`);
  if (kinds.some((k) => !liveOf(k).synced)) return h('p', { class: 'muted' }, 'Loading…');
  return null;
}

/** Loads an object's recent Events into `box` once. */
function eventsInto(box, kind, o) {
  api('GET', `/v1/events/${kind}/${encodeURIComponent(o.metadata.namespace)}/${encodeURIComponent(o.metadata.name)}`)
    .then((events) => {
      const rows = (events || []).map((e) => h('tr', {}, h('td', {}, e.type), h('td', {}, e.reason), h('td', {}, e.message), h('td', {}, ago(e.time))));
      box.replaceChildren(table(['Type', 'Reason', 'Message', 'When'], rows, 'No recent events.'));
    })
    .catch((e) => box.replaceChildren(h('p', { class: 'error' }, e.message)));
}

/** A Delete button that asks once more, then shows the API's answer in `out`. */
function deleteButton(kind, o, out, after) {
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
function rerunButton(o, out) {
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

function specBlock(o) {
  const spec = JSON.parse(JSON.stringify(o.spec || {}));
  const shorten = (s) => (typeof s.file === 'string' && s.file.length > 80 ? { ...s, file: `${s.file.slice(0, 60)}… (${s.file.length} base64 characters)` } : s);
  const shown = Array.isArray(spec.tasks) ? { ...spec, tasks: spec.tasks.map(shorten) } : shorten(spec);
  return h('pre', { class: 'spec' }, JSON.stringify(shown, null, 2));
}

// ---- views: each mounts its fixed parts once and returns how to refresh the live parts ----

const views = {
  fleet(root) {
    const filter = h('input', { type: 'search', id: 'filter', placeholder: 'Filter: name, phase, label=value, version', autocomplete: 'off' });
    const summary = h('div', { class: 'summary' });
    const body = h('div');
    root.append(h('h1', {}, 'Fleet'), h('div', { class: 'toolbar' }, filter), summary, body);
    filter.addEventListener('input', () => refresh());
    const cache = new RowCache();
    const build = (p) => {
      const capacity = p.spec?.capacity;
      const metrics = p.status?.latestMetrics;
      return h('tr', { 'data-name': p.metadata.name, 'data-phase': phaseOf(p) },
        h('td', {}, link(objectHref('proplet', p), p.metadata.name)),
        h('td', {}, p.metadata.namespace),
        h('td', {}, badge(phaseOf(p))),
        h('td', {}, `${p.status?.taskCount ?? 0}${capacity ? ` / ${capacity}` : ''}`),
        h('td', {}, metrics ? `${(metrics.cpuMilliPercent / 1000).toFixed(1)} %` : '—'),
        h('td', {}, metrics ? `${(metrics.memoryBytes / 1048576).toFixed(0)} MiB` : '—'),
        h('td', {}, p.status?.metadata?.propletVersion || '—'),
        h('td', {}, ago(p.status?.lastSeen)),
        h('td', { class: 'labels' }, labelsOf(p).join(', ')),
      );
    };
    // Sorted once per change of the fleet, not at every repaint.
    let proplets = [];
    let seen = -1;
    const refresh = () => {
      const fleet = liveOf('proplet');
      if (seen !== fleet.generation) {
        seen = fleet.generation;
        proplets = [...fleet.items.values()].sort(byKey);
        const counts = {};
        for (const p of proplets) counts[phaseOf(p)] = (counts[phaseOf(p)] || 0) + 1;
        summary.replaceChildren(`${proplets.length} proplets`, ...Object.entries(counts).sort().map(([phase, n]) => h('span', { class: 'count' }, badge(phase), ` ${n}`)));
      }
      const words = filter.value.toLowerCase().split(/\s+/).filter(Boolean);
      const shown = words.length ? proplets.filter((p) => words.every((w) => searchText(p).includes(w))) : proplets;
      const rows = shown.slice(0, ROW_LIMIT).map((p) => cache.row(p, build));
      cache.prune();
      body.replaceChildren(
        statusLine(['proplet']) || '',
        table(['Name', 'Namespace', 'Phase', 'Tasks / capacity', 'CPU', 'Memory', 'Agent', 'Last heartbeat', 'Labels'], rows, 'No proplets match.'),
        shown.length > ROW_LIMIT ? h('p', { class: 'muted' }, `Showing ${ROW_LIMIT} of ${shown.length}; filter to narrow.`) : '',
      );
    };
    return { kinds: ['proplet'], refresh };
  },

  proplet(root, [namespace, name]) {
    const head = h('div');
    const tasks = h('div');
    const events = h('div');
    const out = h('div');
    root.append(head, h('h2', {}, 'Tasks'), tasks, h('h2', {}, 'Recent events'), events, out);
    let eventsLoaded = false;
    const cache = new RowCache();
    const refresh = () => {
      const p = liveOf('proplet').items.get(`${namespace}/${name}`);
      if (!p) {
        head.replaceChildren(h('h1', {}, name), statusLine(['proplet']) || h('p', { class: 'muted' }, 'No such proplet (deleted?).'));
        return;
      }
      if (!eventsLoaded) {
        eventsLoaded = true;
        eventsInto(events, 'proplet', p);
      }
      const m = p.status?.metadata || {};
      head.replaceChildren(
        h('h1', {}, p.metadata.name, ' ', badge(phaseOf(p))),
        h('dl', {},
          h('dt', {}, 'Namespace'), h('dd', {}, namespace),
          h('dt', {}, 'Agent'), h('dd', {}, `${m.propletVersion || '—'} (${m.wasmRuntime || '?'}, ${m.os || '?'}/${m.cpuArch || '?'})`),
          h('dt', {}, 'Host'), h('dd', {}, `${m.hostname || '—'} ${m.ip || ''}`),
          h('dt', {}, 'Last heartbeat'), h('dd', {}, ago(p.status?.lastSeen)),
          h('dt', {}, 'Tasks / capacity'), h('dd', {}, `${p.status?.taskCount ?? 0} / ${p.spec?.capacity ?? 'unlimited'}`),
          h('dt', {}, 'Labels'), h('dd', {}, labelsOf(p).join(', ') || '—'),
        ),
        conditionsTable(p),
      );
      const mine = [...liveOf('task').items.values()].filter((t) => t.metadata.namespace === namespace && t.status?.assignedProplet === name);
      tasks.replaceChildren(taskTable(mine.sort(byKey), cache));
    };
    return { kinds: ['proplet', 'task'], refresh };
  },

  tasks(root) {
    const body = h('div');
    root.append(h('h1', {}, 'Tasks'), body);
    const cache = new RowCache();
    const newestFirst = (a, b) => {
      const [x, y] = [String(a.metadata.creationTimestamp), String(b.metadata.creationTimestamp)];
      return x > y ? -1 : x < y ? 1 : byKey(a, b);
    };
    let all = [];
    let seen = -1;
    const refresh = () => {
      const tasks = liveOf('task');
      if (seen !== tasks.generation) {
        seen = tasks.generation;
        all = [...tasks.items.values()].sort(newestFirst);
      }
      body.replaceChildren(statusLine(['task']) || '', taskTable(all.slice(0, ROW_LIMIT), cache), all.length > ROW_LIMIT ? h('p', { class: 'muted' }, `Showing the newest ${ROW_LIMIT} of ${all.length}.`) : '');
    };
    return { kinds: ['task'], refresh };
  },

  task(root, [namespace, name]) {
    const head = h('div');
    const output = h('pre', { class: 'output' });
    const events = h('div');
    const out = h('div');
    const actions = h('div', { class: 'actions' });
    root.append(head, actions, out, h('h2', {}, 'Output'), output, h('h2', {}, 'Recent events'), events);
    let shownVersion = '';
    const refresh = () => {
      const t = liveOf('task').items.get(`${namespace}/${name}`);
      if (!t) {
        head.replaceChildren(h('h1', {}, name), statusLine(['task']) || h('p', { class: 'muted' }, 'No such task (deleted?).'));
        actions.replaceChildren();
        return;
      }
      if (t.metadata.resourceVersion === shownVersion) return;
      shownVersion = t.metadata.resourceVersion;
      const s = t.status || {};
      head.replaceChildren(
        h('h1', {}, t.metadata.name, ' ', badge(phaseOf(t))),
        h('dl', {},
          h('dt', {}, 'Namespace'), h('dd', {}, namespace),
          h('dt', {}, 'Proplet'), h('dd', {}, s.assignedProplet ? link(`#/proplet/${encodeURIComponent(namespace)}/${encodeURIComponent(s.assignedProplet)}`, s.assignedProplet) : '—'),
          h('dt', {}, 'Result'), h('dd', { id: 'result' }, s.results ?? '—'),
          h('dt', {}, 'Error'), h('dd', {}, s.error || '—'),
          h('dt', {}, 'Runs'), h('dd', {}, s.runCount ?? 0),
          h('dt', {}, 'Started'), h('dd', {}, s.startedAt || '—'),
          h('dt', {}, 'Finished'), h('dd', {}, s.finishedAt || '—'),
        ),
        h('h2', {}, 'Conditions'), conditionsTable(t),
        h('h2', {}, 'Spec'), specBlock(t),
      );
      const owned = t.metadata.labels?.[JOB_LABEL];
      actions.replaceChildren(owned ? link(`#/propellerjob/${encodeURIComponent(namespace)}/${encodeURIComponent(owned)}`, `Part of job ${owned}`) : rerunButton(t, out), deleteButton('task', t, out));
      eventsInto(events, 'task', t);
      api('GET', `/v1/logs/${encodeURIComponent(namespace)}/${encodeURIComponent(name)}`)
        .then((text) => {
          // One JSON object per line: when, which proplet, which stream, what.
          const lines = String(text || '').split('\n').filter(Boolean).map((line) => {
            const l = JSON.parse(line);
            return `${String(l.at).slice(11, 19)} ${l.stream.padEnd(6)} ${l.text}`;
          });
          output.replaceChildren(lines.length ? lines.join('\n') : 'Nothing printed.');
        })
        .catch((e) => output.replaceChildren(`Output unavailable: ${e.message}`));
    };
    return { kinds: ['task'], refresh };
  },

  jobs(root) {
    const body = h('div');
    root.append(h('h1', {}, 'Jobs'), body);
    const refresh = () => {
      const jobRows = [...liveOf('propellerjob').items.values()].sort((a, b) => keyOf(a).localeCompare(keyOf(b))).map((j) => {
        const s = j.status || {};
        return h('tr', { 'data-name': j.metadata.name }, h('td', {}, link(objectHref('propellerjob', j), j.metadata.name)), h('td', {}, j.metadata.namespace), h('td', {}, badge(phaseOf(j))), h('td', {}, `${s.completedCount ?? 0} / ${s.taskCount ?? (j.spec?.tasks || []).length}`), h('td', {}, s.failedCount ?? 0), h('td', {}, ago(s.startTime)));
      });
      const fedRows = [...liveOf('federatedjob').items.values()].sort((a, b) => keyOf(a).localeCompare(keyOf(b))).map((j) => {
        const s = j.status || {};
        return h('tr', { 'data-name': j.metadata.name }, h('td', {}, link(objectHref('federatedjob', j), j.metadata.name)), h('td', {}, j.metadata.namespace), h('td', {}, badge(phaseOf(j))), h('td', {}, `${s.completedRounds ?? 0} / ${j.spec?.rounds?.total ?? '?'}`), h('td', {}, (j.spec?.participants || []).length));
      });
      body.replaceChildren(
        statusLine(['propellerjob', 'federatedjob']) || '',
        h('h2', {}, 'PropellerJobs'), table(['Name', 'Namespace', 'Phase', 'Completed', 'Failed', 'Started'], jobRows, 'No PropellerJobs.'),
        h('h2', {}, 'FederatedJobs'), table(['Name', 'Namespace', 'Phase', 'Rounds', 'Participants'], fedRows, 'No FederatedJobs.'),
      );
    };
    return { kinds: ['propellerjob', 'federatedjob'], refresh };
  },

  propellerjob(root, [namespace, name]) {
    const head = h('div');
    const graph = h('div', { class: 'dag' });
    const out = h('div');
    const actions = h('div', { class: 'actions' });
    root.append(head, actions, out, h('h2', {}, 'Steps'), graph);
    let acted = '';
    const refresh = () => {
      const j = liveOf('propellerjob').items.get(`${namespace}/${name}`);
      if (!j) {
        head.replaceChildren(h('h1', {}, name), statusLine(['propellerjob']) || h('p', { class: 'muted' }, 'No such job (deleted?).'));
        return;
      }
      head.replaceChildren(h('h1', {}, j.metadata.name, ' ', badge(phaseOf(j))), conditionsTable(j));
      if (acted !== j.metadata.uid) {
        acted = j.metadata.uid;
        actions.replaceChildren(rerunButton(j, out), deleteButton('propellerjob', j, out));
      }
      const steps = new Map();
      for (const t of liveOf('task').items.values()) {
        if (t.metadata.namespace !== namespace || t.metadata.labels?.[JOB_LABEL] !== name) continue;
        const step = t.metadata.annotations?.[SPEC_NAME] || t.spec?.name;
        const known = steps.get(step);
        if (!known || String(t.metadata.creationTimestamp) >= String(known.metadata.creationTimestamp)) steps.set(step, t);
      }
      graph.replaceChildren(dag(j.spec?.tasks || [], steps, namespace));
    };
    return { kinds: ['propellerjob', 'task'], refresh };
  },

  federatedjob(root, [namespace, name]) {
    const head = h('div');
    const rounds = h('div', { id: 'rounds' });
    const out = h('div');
    root.append(head, out, h('h2', {}, 'Rounds'), rounds);
    let acted = '';
    const refresh = () => {
      const j = liveOf('federatedjob').items.get(`${namespace}/${name}`);
      if (!j) {
        head.replaceChildren(h('h1', {}, name), statusLine(['federatedjob']) || h('p', { class: 'muted' }, 'No such job (deleted?).'));
        return;
      }
      const s = j.status || {};
      const participants = (s.participants || []).map((p) => h('tr', {}, h('td', {}, p.propletId), h('td', {}, p.status || '—'), h('td', {}, p.updatesDelivered ?? 0), h('td', {}, ago(p.lastUpdate))));
      head.replaceChildren(
        h('h1', {}, j.metadata.name, ' ', badge(phaseOf(j))),
        h('dl', {}, h('dt', {}, 'Round'), h('dd', {}, `${s.currentRound ?? 0} (completed ${s.completedRounds ?? 0} of ${j.spec?.rounds?.total ?? '?'})`), h('dt', {}, 'Aggregated model'), h('dd', {}, s.aggregatedModelRef || '—')),
        h('h2', {}, 'Participants'), table(['Proplet', 'State', 'Updates delivered', 'Last update'], participants, 'No participants yet.'),
        conditionsTable(j),
      );
      if (acted !== j.metadata.uid) {
        acted = j.metadata.uid;
        out.replaceChildren(h('div', { class: 'actions' }, deleteButton('federatedjob', j, out)));
      }
      const mine = [...liveOf('traininground').items.values()]
        .filter((r) => r.metadata.namespace === namespace && r.spec?.federatedJobRef?.name === name)
        .sort((a, b) => String(a.metadata.creationTimestamp).localeCompare(String(b.metadata.creationTimestamp)));
      rounds.replaceChildren(table(['Round', 'Phase', 'Updates', 'Started', 'Ended'], mine.map((r) => h('tr', { 'data-name': r.metadata.name }, h('td', {}, r.spec?.roundId || r.metadata.name), h('td', {}, badge(phaseOf(r))), h('td', {}, `${r.status?.updatesReceived ?? 0} / ${r.status?.updatesRequired ?? r.spec?.kOfN ?? '?'}`), h('td', {}, ago(r.status?.startTime)), h('td', {}, ago(r.status?.endTime)))), 'No rounds yet.'));
    };
    return { kinds: ['federatedjob', 'traininground'], refresh };
  },

  apply(root) {
    const text = h('textarea', { id: 'manifest', rows: 18, spellcheck: 'false', placeholder: 'apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\n…' });
    const out = h('div', { id: 'apply-result' });
    const button = h('button', { type: 'submit', id: 'apply' }, 'Apply');
    const form = h('form', {}, h('label', { for: 'manifest' }, 'A manifest (YAML or JSON, several documents allowed: all are applied or none)'), text, button);
    form.addEventListener('submit', async (event) => {
      event.preventDefault();
      button.disabled = true;
      try {
        const applied = await api('POST', '/v1/apply', text.value);
        out.replaceChildren(h('ul', { class: 'ok' }, applied.map((a) => h('li', {}, `${a.kind} ${a.namespace}/${a.name} ${a.action} `, link(`#/${String(a.kind).toLowerCase()}/${encodeURIComponent(a.namespace)}/${encodeURIComponent(a.name)}`, 'open')))));
      } catch (e) {
        out.replaceChildren(h('pre', { class: 'error' }, e.message));
      } finally {
        button.disabled = false;
      }
    });
    root.append(h('h1', {}, 'Apply'), form, out);
    return { kinds: [], refresh: () => {} };
  },
};

function taskRow(t) {
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

function taskTable(tasks, cache) {
  const rows = tasks.map((t) => cache.row(t, taskRow));
  cache.prune();
  return table(['Name', 'Namespace', 'Phase', 'Proplet', 'Result', 'Started', 'Finished'], rows, 'No tasks.');
}

/** A job's steps as a left-to-right graph: a column per depth, an edge per dependency. */
function dag(specs, tasks, namespace) {
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

// ---- sign-in, routing, refresh scheduling ----

let current = null;
let unsubscribe = [];
let scheduled = false;

let lastRepaint = 0;

function schedule() {
  if (scheduled || !current) return;
  scheduled = true;
  // However fast the watches stream: a few repaints a second at most, and the page spends
  // at most a fifth of its time repainting.
  setTimeout(() => requestAnimationFrame(() => {
    scheduled = false;
    const started = performance.now();
    if (current) current.refresh();
    renderLiveState();
    lastRepaint = performance.now() - started;
  }), Math.max(250, 4 * lastRepaint));
}

function renderLiveState() {
  const state = document.getElementById('live-state');
  const kinds = current?.kinds || [];
  const error = kinds.map((k) => liveOf(k).error).find(Boolean);
  state.textContent = error ? 'reconnecting' : kinds.length ? 'live' : '';
  state.className = `live-state ${error ? 'down' : 'up'}`;
}

function stopWatches() {
  for (const l of Object.values(live)) l.stop();
  for (const key of Object.keys(live)) delete live[key];
}

let loginMessage = '';

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  stopWatches();
  loginMessage = message || '';
  if (location.hash === '#/login') route();
  else location.hash = '#/login';
}

function loginView(root) {
  const message = loginMessage;
  loginMessage = '';
  const input = h('input', { type: 'password', id: 'token', autocomplete: 'off', required: true });
  const out = h('div', { id: 'login-error' }, message ? h('p', { class: 'error' }, message) : '');
  const form = h('form', { class: 'login' },
    h('h1', {}, 'Sign in'),
    h('label', { for: 'token' }, 'Bearer token'),
    input,
    h('p', { class: 'muted' }, 'Standalone: the api-token file in propeller\'s data directory. Kubernetes: a token the API server accepts, such as one from `kubectl create token`.'),
    h('button', { type: 'submit', id: 'sign-in' }, 'Sign in'),
    out,
  );
  // After signing in: the page asked for (a link followed while signed out), or the fleet.
  const enter = () => {
    if (location.hash && location.hash !== '#/login') route();
    else location.hash = '#/fleet';
  };
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    try {
      await api('GET', `/v1/objects/proplet${namespace() ? `?namespace=${encodeURIComponent(namespace())}` : ''}`);
      enter();
    } catch (e) {
      // 403: the token is good, only not for every namespace; the views say what is missing.
      if (e.status === 403) {
        enter();
        return;
      }
      sessionStorage.removeItem(TOKEN_KEY);
      out.replaceChildren(h('p', { class: 'error' }, e.message));
    }
  });
  root.append(form);
  input.focus();
}

function route() {
  for (const off of unsubscribe) off();
  unsubscribe = [];
  current = null;
  const main = document.getElementById('main');
  main.replaceChildren();
  const signedIn = Boolean(token());
  document.getElementById('nav').hidden = !signedIn;
  const [name, ...args] = location.hash.replace(/^#\/?/, '').split('/').map(decodeURIComponent);
  if (!signedIn || name === 'login') return loginView(main);
  const view = views[name] || views.fleet;
  for (const a of document.querySelectorAll('#nav a')) a.classList.toggle('active', a.dataset.view === name);
  current = view(main, args);
  // Watches no view needs any more are closed; the browser allows few connections per host.
  for (const [kind, l] of Object.entries(live)) if (!current.kinds.includes(kind)) l.stop();
  for (const kind of Object.keys(live)) if (!current.kinds.includes(kind)) delete live[kind];
  unsubscribe = current.kinds.map((kind) => liveOf(kind).subscribe(schedule));
  current.refresh();
  renderLiveState();
}

document.getElementById('sign-out').addEventListener('click', () => signOut(''));
const namespaceField = document.getElementById('namespace');
namespaceField.value = namespace();
namespaceField.addEventListener('change', () => {
  sessionStorage.setItem(NAMESPACE_KEY, namespaceField.value.trim());
  stopWatches();
  route();
});
window.addEventListener('hashchange', () => route());
setInterval(schedule, 5000); // "ago" columns age even when nothing changes
route();
