//! The web console's page, script and style sheet, built into the binary and served by both
//! modes: standalone beside its API, a cluster's on `propeller run --console-listen`. The
//! page reads and changes objects only through the API routes of the server it came from
//! (`/v1/...`), with the bearer token the user signs in with; the files themselves hold no
//! data and are served to anyone, so the sign-in page can load.

use axum::http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, REFERRER_POLICY, X_CONTENT_TYPE_OPTIONS,
    X_FRAME_OPTIONS,
};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

/// Where the console is served.
pub const PATH: &str = "/console/";

/// The API routes the console's scripts call: both modes serve them (standalone's API, and
/// on a cluster `crate::k8s::console_api`), and the CLI uses the standalone ones.
pub mod routes {
    /// `POST`: a manifest, all documents or none.
    pub const APPLY: &str = "/v1/apply";
    /// `GET`: every object of a kind.
    pub const OBJECTS: &str = "/v1/objects/{kind}";
    /// `GET`, `DELETE`: one object.
    pub const OBJECT: &str = "/v1/objects/{kind}/{namespace}/{name}";
    /// `GET`: an object's recent Events.
    pub const EVENTS: &str = "/v1/events/{kind}/{namespace}/{name}";
    /// `GET`: a kind's objects, then their changes, one JSON event per line.
    pub const WATCH: &str = "/v1/watch/{kind}";
    /// `GET`: what a Task printed.
    pub const LOGS: &str = "/v1/logs/{namespace}/{name}";
}

/// Scripts, styles and requests only from the same origin; no inline code, no frames, no
/// plugins, no form posts elsewhere.
pub const CONTENT_SECURITY_POLICY_VALUE: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; connect-src 'self'; img-src 'self'; base-uri 'none'; \
     form-action 'self'; frame-ancestors 'none'";

const INDEX: &str = include_str!("../console/index.html");
const STYLE: &str = include_str!("../console/console.css");
/// The scripts (ES modules): `console.js` loads the others.
const SCRIPTS: [(&str, &str); 4] = [
    ("console.js", include_str!("../console/console.js")),
    ("api.js", include_str!("../console/api.js")),
    ("render.js", include_str!("../console/render.js")),
    ("views.js", include_str!("../console/views.js")),
];

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (CONTENT_TYPE, content_type),
            (CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY_VALUE),
            (X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (X_FRAME_OPTIONS, "DENY"),
            (REFERRER_POLICY, "no-referrer"),
            // A new binary's console replaces the old one at once.
            (CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// The console's routes, to merge into a server's router.
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    let mut router = Router::new()
        .route("/", get(|| async { Redirect::to(PATH) }))
        .route("/console", get(|| async { Redirect::to(PATH) }))
        .route(
            PATH,
            get(|| async { asset("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/console/console.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        );
    for (name, body) in SCRIPTS {
        router = router.route(
            &format!("{PATH}{name}"),
            get(move || async move { asset("text/javascript; charset=utf-8", body) }),
        );
    }
    router
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_only_files_the_router_serves() {
        for reference in ["/console/console.js", "/console/console.css"] {
            assert!(
                INDEX.contains(reference),
                "index.html should load {reference}"
            );
        }
        assert!(
            !INDEX.contains("<script>") && !INDEX.contains("style="),
            "inline code or styles would be refused by the Content-Security-Policy"
        );
        let served: Vec<&str> = SCRIPTS.iter().map(|(name, _)| *name).collect();
        for (name, script) in SCRIPTS {
            assert!(
                !script.contains("innerHTML"),
                "{name}: values must reach the page as text"
            );
            for import in script.split("from './").skip(1) {
                let file = import.split('\'').next().unwrap_or_default();
                assert!(
                    served.contains(&file),
                    "{name} imports {file}, which is not served"
                );
            }
        }
    }
}
