// The console's side of propeller's API: the session's token and namespace, calls that
// answer with the API's own message, and live copies of a kind's objects through the watch
// streams (`Live`), resuming where a stream broke off.

/** What the page does when the token stops working; set by console.js. */
export const session = {
  /** Whether a signed-in view is showing (a refusal on the sign-in form is the form's own). */
  active: () => false,
  /** Ends the session with the API's message. */
  expired: (message) => {},
};

export const TOKEN_KEY = 'propeller-console-token';
export const NAMESPACE_KEY = 'propeller-console-namespace';
const INITIAL_EVENTS_END = 'k8s.io/initial-events-end';


/** Counts what the page was sent, for `scripts/bench-console.sh`. */
export const stats = { watchCharacters: 0 };
window.propellerConsoleStats = stats;

export const token = () => sessionStorage.getItem(TOKEN_KEY) || '';
export const namespace = () => sessionStorage.getItem(NAMESPACE_KEY) || '';
export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
export const keyOf = (o) => `${o.metadata?.namespace || ''}/${o.metadata?.name || ''}`;

export class ApiError extends Error {
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
export async function api(method, path, body, contentType = 'application/yaml') {
  const headers = { Authorization: `Bearer ${token()}` };
  if (body !== undefined) headers['Content-Type'] = contentType;
  const res = await fetch(path, { method, headers, body, cache: 'no-store' });
  if (!res.ok) {
    const error = await errorOf(res);
    // A token that stopped working (expired, rotated) ends the session; the sign-in form
    // shows its own refusals.
    if (res.status === 401 && session.active()) session.expired(error.message);
    throw error;
  }
  const type = res.headers.get('content-type') || '';
  return type.startsWith('application/json') ? res.json() : res.text();
}

/** Every object of one kind, kept current by a watch that resumes where it broke off. */
export class Live {
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
          if (res.status === 401) return session.expired(error.message);
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

export const live = {};
export const liveOf = (kind) => (live[kind] ||= new Live(kind));
