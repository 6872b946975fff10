// The console's pages. Each mounts its fixed parts once and returns the kinds it watches and
// how to refresh its live parts.

import { api, keyOf, liveOf } from './api.js';
import {
  ROW_LIMIT, RowCache, SPEC_NAME, JOB_LABEL, ago, badge, byKey, conditionsTable, dag, deleteButton,
  eventsInto, h, labelsOf, link, objectHref, phaseOf, rerunButton, searchText, specBlock,
  statusLine, table, taskTable,
} from './render.js';

export const views = {
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
