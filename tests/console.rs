//! The web console in a real browser (Debian's headless Chromium over WebDriver): signing in,
//! a wrong token refused, the quickstart's proplet and a pipeline's DAG following the objects
//! live, a task applied, rerun and deleted from the page; on a cluster, users the API server
//! knows, each seeing and changing only what RBAC lets them, refusals in the API's words.
//! Screenshots go to `target/console-screenshots/`.

mod support;

use std::time::Duration;

use support::browser::Browser;
use support::envtest::{free_port, Options};
use support::kube::{apply, cluster, operator_command, wait_gone, wait_phase};
use support::standalone::{apply_text, inline_task};
use support::{propeller_client, start_standalone, Running};

/// The quickstart's pipeline under another name.
fn pipeline_named(name: &str) -> String {
    let text = std::fs::read_to_string(
        support::repo_root().join("configs/samples/quickstart/pipeline.yaml"),
    )
    .expect("read the quickstart pipeline");
    text.replace("name: pipeline\n", &format!("name: {name}\n"))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

#[test]
fn standalone_console_signs_in_follows_the_fleet_live_and_applies_reruns_and_deletes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, api, mqtt) = start_standalone(dir.path(), &["--demo"]);
    let token = std::fs::read_to_string(dir.path().join("api-token")).expect("api token");
    let token = token.trim().to_owned();
    let base = format!("http://{api}/console/");
    runtime().block_on(async {
        let Some(browser) = Browser::start().await else {
            return;
        };
        browser.client.goto(&base).await.expect("open the console");

        // A wrong token is refused with the API's message; nothing else is shown.
        browser.fill("#token", "not-the-token").await;
        browser.click("#sign-in").await;
        let refused = browser
            .wait_for_text("#login-error", "wrong bearer token")
            .await;
        println!("a wrong token: {refused:?}");
        browser.screenshot("login-refused").await;

        browser.fill("#token", &token).await;
        browser.click("#sign-in").await;
        browser
            .wait_for(r#"tr[data-name="quickstart-proplet"][data-phase="Running"]"#)
            .await;
        browser
            .wait_for_text("tr[data-name=\"quickstart-proplet\"]", "0.1.0")
            .await;
        browser.screenshot("fleet").await;

        // A device added while the page is open appears, then goes Running once its agent
        // connects.
        apply_text(
            &api,
            dir.path(),
            "pi-live.yaml",
            &support::device_manifest("pi-live", &mqtt),
        );
        browser.wait_for(r#"tr[data-name="pi-live"]"#).await;
        // Read in the page: the table is redrawn as changes arrive.
        let before = browser
            .client
            .execute(
                r#"return document.querySelector('tr[data-name="pi-live"]').dataset.phase"#,
                vec![],
            )
            .await
            .expect("read the row's phase");
        let before = before.as_str().unwrap_or_default().to_owned();
        assert_ne!(before, "Running", "no agent runs yet");
        let _agent = support::device_agent("pi-live", &mqtt, &dir.path().join("pi-live-state"));
        browser
            .wait_for(r#"tr[data-name="pi-live"][data-phase="Running"]"#)
            .await;
        println!("a new device on the open Fleet page: {before}, then Running");

        // A job's page open before the job exists follows it: the graph appears and its steps
        // turn green without a reload.
        browser
            .client
            .goto(&format!("{base}#/propellerjob/default/later"))
            .await
            .expect("open a job's page");
        browser.wait_for_text("main", "No such job").await;
        apply_text(&api, dir.path(), "later.yaml", &pipeline_named("later"));
        for step in ["step-one", "step-two"] {
            browser
                .wait_for(&format!(
                    r#"g.node[data-step="{step}"][data-phase="completed"]"#
                ))
                .await;
        }
        browser.wait_for_text("h1", "Completed").await;
        browser.screenshot("pipeline").await;

        // A task applied from the page, run again, and deleted.
        browser
            .client
            .goto(&format!("{base}#/apply"))
            .await
            .expect("open Apply");
        browser
            .fill("#manifest", &inline_task("from-console", "[20, 22]"))
            .await;
        browser.click("#apply").await;
        browser
            .wait_for_text("#apply-result", "Task default/from-console created")
            .await;
        browser.click("#apply-result a").await;
        browser.wait_for_text("#result", "42").await;
        browser.click(r#"button[data-action="rerun"]"#).await;
        browser.wait_for_text("h1", "from-console-rerun-").await;
        browser.wait_for_text("#result", "42").await;
        browser.screenshot("task").await;
        browser.click(r#"button[data-action="delete"]"#).await;
        browser
            .wait_for_text("button[data-action=\"delete\"]", "?")
            .await;
        browser.click(r#"button[data-action="delete"]"#).await;
        // The agent is told to stop it first: "deleting (waiting for finalizers)", then gone.
        browser.wait_for_text(".ok", "from-console-rerun-").await;
        browser.wait_for_text("main", "No such task").await;

        // A federated job's page: its rounds appear and finish as they happen.
        let (http, stop_serving) = support::serve_file(support::fl_module());
        let mut participants = Vec::new();
        for name in ["a", "bb"] {
            apply_text(
                &api,
                dir.path(),
                &format!("{name}.yaml"),
                &support::device_manifest(name, &mqtt),
            );
            participants.push(support::device_agent(
                name,
                &mqtt,
                &dir.path().join(format!("{name}-state")),
            ));
        }
        browser
            .client
            .goto(&format!("{base}#/federatedjob/default/fl"))
            .await
            .expect("open a federated job's page");
        browser.wait_for_text("main", "No such job").await;
        apply_text(
            &api,
            dir.path(),
            "fl.yaml",
            &support::federated_job_manifest(&http),
        );
        browser.wait_for_text("h1", "Completed").await;
        let started = std::time::Instant::now();
        loop {
            let done = browser
                .client
                .execute(
                    "return document.querySelectorAll('#rounds .phase-completed').length",
                    vec![],
                )
                .await
                .expect("count the finished rounds");
            if done.as_u64() == Some(2) {
                break;
            }
            assert!(
                started.elapsed() < support::browser::PAGE_WAIT,
                "the page shows {done} finished rounds, not 2"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        browser.screenshot("federated").await;
        stop_serving.store(true, std::sync::atomic::Ordering::Relaxed);
        drop(participants);

        // What the page did is what the API holds.
        let (ok, out, err) = propeller_client(&api, dir.path(), &["get", "tasks"]);
        assert!(ok, "{err}");
        assert!(
            out.contains("from-console "),
            "the applied task stays: {out}"
        );
        assert!(
            !out.contains("from-console-rerun-"),
            "the rerun was deleted: {out}"
        );
        browser.close().await;
    });
}

/// `propeller run` with the console on a free port; the process, the console's port and the
/// MQTT port.
fn operator_with_console(
    kubeconfig: &std::path::Path,
    tls: &std::path::Path,
) -> (Running, u16, u16) {
    let port = free_port();
    let mut cmd = operator_command(kubeconfig, free_port());
    cmd.args(["--console-listen", &format!("127.0.0.1:{port}")])
        .arg("--console-tls-dir")
        .arg(tls)
        .env("HOSTNAME", "console-operator");
    let operator = Running::spawn(cmd);
    // The broker's line comes first; each line is read once.
    let mqtt = support::kube::mqtt_port(&operator);
    operator.stderr_line_within("web console listening", Duration::from_secs(60));
    (operator, port, mqtt)
}

#[test]
fn cluster_console_lets_users_see_and_change_only_what_rbac_allows() {
    let ns = "console";
    let Some((cp, kubeconfig)) = cluster(Options::default()) else {
        return;
    };
    let (operator, port, mqtt) =
        operator_with_console(&kubeconfig, &cp.scratch().join("console-tls"));
    cp.kubectl_ok(&["create", "namespace", ns]);
    apply(&cp, ns, &support::device_manifest("pi-1", mqtt));
    let _agent = support::device_agent("pi-1", mqtt, &cp.scratch().join("pi-1-state"));
    wait_phase(&cp, ns, "proplet", "pi-1", "Running");
    apply(&cp, ns, &support::kube::task_manifest("seen", "[1, 2]", ""));
    wait_phase(&cp, ns, "task", "seen", "completed");
    // A viewer who may read propeller's objects in every namespace, and an editor who may
    // also change Tasks.
    apply(
        &cp,
        ns,
        "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: viewer\n---\n\
apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: editor\n---\n\
apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata:\n  name: propeller-console-viewer\nrules:\n- apiGroups: [propeller.propeller.absmach.eu]\n  resources: [proplets, tasks, tasks/log, propellerjobs, federatedjobs, trainingrounds]\n  verbs: [get, list, watch]\n---\n\
apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n  name: propeller-console-viewer\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: ClusterRole\n  name: propeller-console-viewer\nsubjects:\n- kind: ServiceAccount\n  name: viewer\n  namespace: console\n- kind: ServiceAccount\n  name: editor\n  namespace: console\n---\n\
apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata:\n  name: task-editor\nrules:\n- apiGroups: [propeller.propeller.absmach.eu]\n  resources: [tasks]\n  verbs: [create, patch, delete]\n---\n\
apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata:\n  name: task-editor\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: Role\n  name: task-editor\nsubjects:\n- kind: ServiceAccount\n  name: editor\n  namespace: console\n",
    );
    let viewer = cp.kubectl_ok(&["-n", ns, "create", "token", "viewer"]);
    let editor = cp.kubectl_ok(&["-n", ns, "create", "token", "editor"]);
    let (viewer, editor) = (viewer.trim().to_owned(), editor.trim().to_owned());
    support::secret(viewer.as_str());
    support::secret(editor.as_str());
    let base = format!("https://127.0.0.1:{port}/console/");
    runtime().block_on(async {
        let Some(browser) = Browser::start().await else {
            return;
        };
        browser.client.goto(&base).await.expect("open the console");
        browser.fill("#token", "not-a-token").await;
        browser.click("#sign-in").await;
        browser
            .wait_for_text("#login-error", "does not accept this token")
            .await;

        browser.fill("#token", &viewer).await;
        browser.click("#sign-in").await;
        browser
            .wait_for(r#"tr[data-name="pi-1"][data-phase="Running"]"#)
            .await;
        browser.screenshot("cluster-fleet").await;
        browser
            .client
            .goto(&format!("{base}#/task/{ns}/seen"))
            .await
            .expect("open a task");
        browser.wait_for_text("#result", "3").await;
        // The viewer may not delete: the API server's refusal, word for word.
        browser.click(r#"button[data-action="delete"]"#).await;
        browser.click(r#"button[data-action="delete"]"#).await;
        let refused = browser.wait_for_text(".error", "forbidden").await;
        assert!(
            refused.contains("system:serviceaccount:console:viewer"),
            "{refused}"
        );
        println!("the viewer's delete: {refused:?}");

        browser.click("#sign-out").await;
        browser.fill("#token", &editor).await;
        browser.click("#sign-in").await;
        browser.wait_for(r#"tr[data-name="pi-1"]"#).await;
        browser
            .client
            .goto(&format!("{base}#/apply"))
            .await
            .expect("open Apply");
        let manifest = support::kube::task_manifest("from-console", "[40, 2]", "")
            .replace("metadata:\n", &format!("metadata:\n  namespace: {ns}\n"));
        browser.fill("#manifest", &manifest).await;
        browser.click("#apply").await;
        browser
            .wait_for_text("#apply-result", "Task console/from-console created")
            .await;
        browser.click("#apply-result a").await;
        browser.wait_for_text("#result", "42").await;
        browser.screenshot("cluster-task").await;
        browser.click(r#"button[data-action="delete"]"#).await;
        browser.click(r#"button[data-action="delete"]"#).await;
        browser.wait_for_text(".ok", "from-console").await;
        browser.close().await;
    });
    wait_gone(&cp, ns, "task", "from-console");
    drop(operator);
}
