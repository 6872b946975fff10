// Propeller's web console: one page over propeller's HTTP API (`/v1/...`), kept live by its
// watch streams. The bearer token stays in this tab's sessionStorage and goes only in the
// Authorization header of requests to this origin. No HTML is built from strings: every
// value reaches the page as text nodes or attributes.
//
// This file signs in, routes between the pages (views.js) and schedules their repaints; the
// API and the live watches are in api.js, the page building blocks in render.js.

import { NAMESPACE_KEY, TOKEN_KEY, api, live, liveOf, namespace, session, token } from './api.js';
import { h } from './render.js';
import { views } from './views.js';

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

session.active = () => Boolean(current);
session.expired = (message) => signOut(message);
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
