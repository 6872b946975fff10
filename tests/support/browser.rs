//! A real browser for tests of web pages: Debian's headless Chromium driven over WebDriver
//! (Debian's chromedriver, on an ephemeral loopback port, stopped by pid) with fantoccini.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::elements::Element;
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;

use super::envtest::{free_port, pdeathsig};
use super::repo_root;

/// How long a page has to show what a test waits for.
pub const PAGE_WAIT: Duration = Duration::from_secs(30);

/// A headless Chromium session, and the chromedriver serving it.
pub struct Browser {
    pub client: Client,
    driver: Child,
}

/// Why no browser can run here, if so.
pub fn unavailable() -> Option<String> {
    for tool in ["/usr/bin/chromium", "/usr/bin/chromedriver"] {
        if !std::path::Path::new(tool).exists() {
            return Some(format!(
                "no {tool} (Debian's chromium and chromium-driver packages)"
            ));
        }
    }
    None
}

impl Browser {
    /// Starts chromedriver and a headless Chromium; `None` (after one SKIPPED line) without
    /// them outside CI, a failure under `CI=true`.
    pub async fn start() -> Option<Self> {
        if let Some(why) = unavailable() {
            assert!(
                std::env::var("CI").is_err(),
                "CI=true needs a browser: {why}"
            );
            eprintln!("SKIPPED: {why}");
            return None;
        }
        let port = free_port();
        let mut cmd = Command::new("/usr/bin/chromedriver");
        cmd.arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        pdeathsig(&mut cmd);
        // Its own process group, so the browsers it starts are stopped with it.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let driver = cmd.spawn().expect("start chromedriver");
        let capabilities = json!({
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1400,1000"],
            },
            // The console on a cluster serves a certificate the test made; the page's
            // behaviour, not the browser's trust store, is under test.
            "acceptInsecureCerts": true,
        });
        let capabilities = match capabilities {
            serde_json::Value::Object(map) => map,
            _ => unreachable!("an object literal"),
        };
        let started = Instant::now();
        let client = loop {
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            match ClientBuilder::new(connector)
                .capabilities(capabilities.clone())
                .connect(&format!("http://127.0.0.1:{port}"))
                .await
            {
                Ok(client) => break client,
                Err(e) => {
                    assert!(
                        started.elapsed() < Duration::from_secs(30),
                        "no browser session from chromedriver: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        Some(Self { client, driver })
    }

    /// The first element `css` matches once there is one.
    pub async fn wait_for(&self, css: &str) -> Element {
        match self
            .client
            .wait()
            .at_most(PAGE_WAIT)
            .for_element(Locator::Css(css))
            .await
        {
            Ok(found) => found,
            Err(e) => {
                let page = self.failure_evidence().await;
                panic!("no element {css} on the page within {PAGE_WAIT:?}: {e}; {page}")
            }
        }
    }

    /// Waits until an element `css` matches shows text containing `text`; that text.
    pub async fn wait_for_text(&self, css: &str, text: &str) -> String {
        let started = Instant::now();
        let mut last = String::new();
        while started.elapsed() < PAGE_WAIT {
            if let Ok(found) = self.client.find_all(Locator::Css(css)).await {
                for element in found {
                    if let Ok(shown) = element.text().await {
                        if shown.contains(text) {
                            return shown;
                        }
                        last = shown;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let page = self.failure_evidence().await;
        panic!("{css} never showed {text:?} within {PAGE_WAIT:?}; last: {last:?}; {page}")
    }

    /// A screenshot of the page as it is, and its text, for a failure's message.
    async fn failure_evidence(&self) -> String {
        let shot = self.screenshot("failure").await;
        let text = match self.client.find(Locator::Css("body")).await {
            Ok(body) => body.text().await.unwrap_or_default(),
            Err(e) => format!("(no body: {e})"),
        };
        format!("the page ({}) shows: {text:?}", shot.display())
    }

    /// Waits until nothing matches `css`.
    pub async fn wait_gone(&self, css: &str) {
        let started = Instant::now();
        while started.elapsed() < PAGE_WAIT {
            match self.client.find_all(Locator::Css(css)).await {
                Ok(found) if found.is_empty() => return,
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        panic!("{css} still on the page after {PAGE_WAIT:?}")
    }

    /// Types `text` into the element `css` matches, replacing what it held.
    pub async fn fill(&self, css: &str, text: &str) {
        let field = self.wait_for(css).await;
        field.clear().await.expect("clear a field");
        field.send_keys(text).await.expect("type into a field");
    }

    /// Clicks the element `css` matches.
    pub async fn click(&self, css: &str) {
        self.wait_for(css)
            .await
            .click()
            .await
            .unwrap_or_else(|e| panic!("click {css}: {e}"));
    }

    /// Saves a screenshot as `target/console-screenshots/{name}.png`; its path.
    pub async fn screenshot(&self, name: &str) -> PathBuf {
        let png = self.client.screenshot().await.expect("take a screenshot");
        let dir = repo_root().join("target/console-screenshots");
        std::fs::create_dir_all(&dir).expect("screenshot directory");
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, png).expect("write the screenshot");
        path
    }

    /// Ends the session; chromedriver is stopped when the value is dropped.
    pub async fn close(self) {
        let _ = self.client.clone().close().await;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // The whole group: chromedriver and every browser process it started.
        if let Ok(pid) = i32::try_from(self.driver.id()) {
            unsafe { libc::kill(-pid, libc::SIGKILL) };
        }
        let _ = self.driver.wait();
    }
}
