//! The image puller and the chunk server against a real registry and a real broker: one
//! registry pull however many resolutions run at once, and one MQTT transfer for every
//! device that asked together.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use propeller_broker::server::{BrokerConfig, Credential, CredentialStore, EmbeddedBroker, Role};
use propeller_operator::oci::{ImagePuller, ImageServer, PullerConfig, RegistryLogins};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use support::registry::{add_module, Layout, Registry};

fn puller(registry: &Registry, cache: &std::path::Path) -> Arc<ImagePuller> {
    puller_trusting(registry, cache, registry.ca_pem.clone())
}

fn puller_trusting(
    registry: &Registry,
    cache: &std::path::Path,
    ca: Option<String>,
) -> Arc<ImagePuller> {
    let plain_http = match registry.ca_pem {
        Some(_) => Vec::new(),
        None => vec![registry.host.clone()],
    };
    Arc::new(
        ImagePuller::new(PullerConfig {
            max_bytes: 100 << 20,
            timeout: Duration::from_secs(20),
            plain_http,
            extra_ca_pem: ca.map(String::into_bytes),
            cache_dir: cache.to_owned(),
            cache_bytes: 1 << 30,
        })
        .expect("puller"),
    )
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
fn concurrent_resolutions_share_one_registry_pull_and_later_ones_use_the_cache() {
    let Some(registry) = Registry::start(None) else {
        return;
    };
    let module = add_module(1 << 20);
    registry.push("wasm/big:1", &module, Layout::WasmArtifact);
    let cache = tempfile::tempdir().expect("cache dir");
    let puller = puller(&registry, cache.path());
    let image = format!("{}/wasm/big:1", registry.host);
    let resolved = runtime().block_on(async {
        let all = (0..8).map(|_| {
            let (puller, image) = (puller.clone(), image.clone());
            tokio::spawn(async move { puller.resolve(&image, &RegistryLogins::default()).await })
        });
        let mut out = Vec::new();
        for handle in all {
            out.push(handle.await.expect("join").expect("resolve"));
        }
        out
    });
    let layer = resolved[0].layer_digest.clone();
    assert!(resolved.iter().all(|r| r == &resolved[0]));
    assert_eq!(resolved[0].size, module.len() as u64);
    assert_eq!(registry.blob_gets(&layer), 1);
    runtime().block_on(async {
        let again = puller
            .resolve(&image, &RegistryLogins::default())
            .await
            .expect("resolve from cache");
        assert_eq!(again, resolved[0]);
        let served = puller.binary(&again.pinned).await.expect("binary");
        assert_eq!(served.as_deref(), Some(module.as_slice()));
    });
    assert_eq!(registry.blob_gets(&layer), 1);
}

#[test]
fn a_registry_with_a_private_ca_is_trusted_only_with_its_ca() {
    let Some(registry) = Registry::start_tls() else {
        return;
    };
    let digest = registry.push("wasm/add:1", &add_module(0), Layout::WasmArtifact);
    let image = format!("{}/wasm/add:1", registry.host);
    let cache = tempfile::tempdir().expect("cache dir");
    let untrusting = puller_trusting(&registry, &cache.path().join("a"), None);
    let trusting = puller(&registry, &cache.path().join("b"));
    runtime().block_on(async {
        let refused = untrusting
            .resolve(&image, &RegistryLogins::default())
            .await
            .expect_err("an unknown CA must not be trusted");
        assert!(
            refused.to_string().to_lowercase().contains("certificate"),
            "{refused}"
        );
        let resolved = trusting
            .resolve(&image, &RegistryLogins::default())
            .await
            .expect("resolve over TLS with the CA");
        assert_eq!(resolved.manifest_digest, digest);
    });
}

/// Collects `registry/server` chunks seen by a subscriber until `quiet` passes without one.
async fn chunks_until_quiet(
    eventloop: &mut rumqttc::EventLoop,
    quiet: Duration,
) -> Vec<serde_json::Value> {
    let mut chunks = Vec::new();
    while let Ok(event) = tokio::time::timeout(quiet, eventloop.poll()).await {
        if let Ok(Event::Incoming(Packet::Publish(p))) = event {
            chunks.push(serde_json::from_slice(&p.payload).expect("chunk JSON"));
        }
    }
    chunks
}

#[test]
fn devices_asking_together_get_one_transfer_and_latecomers_another() {
    let Some(registry) = Registry::start(None) else {
        return;
    };
    let module = add_module(1_200_000);
    registry.push("wasm/big:1", &module, Layout::WasmArtifact);
    let cache = tempfile::tempdir().expect("cache dir");
    let puller = puller(&registry, cache.path());
    runtime().block_on(async {
        let resolved = puller
            .resolve(
                &format!("{}/wasm/big:1", registry.host),
                &RegistryLogins::default(),
            )
            .await
            .expect("resolve");
        let logins = Arc::new(CredentialStore::new());
        logins.insert("watch", Credential::new("watch-key", Role::Service));
        let broker = EmbeddedBroker::start(BrokerConfig::loopback(), logins)
            .await
            .expect("broker");
        let port = broker.tcp_addr().expect("tcp").port();
        let mut options = MqttOptions::new("watch", "127.0.0.1", port);
        options.set_credentials("watch", "watch-key");
        options.set_max_packet_size(4 << 20, 4 << 20);
        let (client, mut eventloop) = AsyncClient::new(options, 64);
        client
            .subscribe("m/d1/c/c1/registry/server", QoS::AtMostOnce)
            .await
            .expect("subscribe");
        let deadline = Instant::now() + support::WAIT;
        loop {
            assert!(Instant::now() < deadline, "no SUBACK");
            if let Ok(Event::Incoming(Packet::SubAck(_))) = eventloop.poll().await {
                break;
            }
        }
        let server = Arc::new(ImageServer::new(puller.clone(), broker.publisher(), 0));
        for device in 0..10 {
            server.request(&format!("dev-{device}"), "d1", "c1", &resolved.pinned);
        }
        let chunks = chunks_until_quiet(&mut eventloop, Duration::from_secs(2)).await;
        assert_eq!(server.transfers_sent(), 1);
        assert_eq!(chunks.len(), 3, "1.2 MB in 512,000-byte chunks");
        let mut joined = Vec::new();
        for (idx, chunk) in chunks.iter().enumerate() {
            assert_eq!(chunk["app_name"], resolved.pinned.as_str());
            assert_eq!(chunk["chunk_idx"], idx);
            assert_eq!(chunk["total_chunks"], 3);
            use base64::Engine as _;
            joined.extend(
                base64::engine::general_purpose::STANDARD
                    .decode(chunk["data"].as_str().unwrap_or_default())
                    .expect("base64"),
            );
        }
        assert_eq!(joined, module);

        // A device that asks while a (slowly paced) round runs gets only what it missed.
        let slow = Arc::new(ImageServer::new(
            puller.clone(),
            broker.publisher(),
            1_500_000,
        ));
        slow.request("early", "d1", "c1", &resolved.pinned);
        let mut seen = Vec::new();
        while seen.len() < 2 {
            if let Ok(Ok(Event::Incoming(Packet::Publish(p)))) =
                tokio::time::timeout(support::WAIT, eventloop.poll()).await
            {
                let chunk: serde_json::Value = serde_json::from_slice(&p.payload).expect("chunk");
                seen.push(chunk["chunk_idx"].as_u64().unwrap_or(99));
            }
        }
        slow.request("late", "d1", "c1", &resolved.pinned);
        seen.extend(
            chunks_until_quiet(&mut eventloop, Duration::from_secs(2))
                .await
                .iter()
                .map(|c| c["chunk_idx"].as_u64().unwrap_or(99)),
        );
        assert_eq!(slow.transfers_sent(), 2, "{seen:?}");
        let (full, resent) = seen.split_at(3);
        assert_eq!(full, [0, 1, 2]);
        assert!(
            !resent.is_empty()
                && resent.len() < 3
                && resent.iter().copied().eq(0..resent.len() as u64),
            "the late device is sent the chunks before its request only: {seen:?}"
        );

        // A device asking again (a second task waiting for the same image) gets it again.
        server.request("dev-0", "d1", "c1", &resolved.pinned);
        let again = chunks_until_quiet(&mut eventloop, Duration::from_secs(2)).await;
        assert_eq!((server.transfers_sent(), again.len()), (2, 3));

        // A name no task resolved is not served: devices cannot make propeller pull.
        let other = format!("{}/wasm/other@sha256:{}", registry.host, "0".repeat(64));
        server.request("dev-1", "d1", "c1", &other);
        let none = chunks_until_quiet(&mut eventloop, Duration::from_secs(1)).await;
        assert!(none.is_empty());
        assert_eq!(server.transfers_sent(), 2);
    });
}

#[test]
fn a_plain_http_registry_named_without_the_flag_gets_an_error_that_names_the_flag() {
    let Some(registry) = Registry::start(None) else {
        return;
    };
    assert!(
        registry.ca_pem.is_none(),
        "Registry::start serves plain HTTP"
    );
    registry.push("wasm/add:1", &add_module(1 << 10), Layout::WasmArtifact);
    let cache = tempfile::tempdir().expect("cache dir");
    // Trusting HTTPS for every registry, as a user who forgot --registry-plain-http.
    let puller = Arc::new(
        ImagePuller::new(PullerConfig {
            max_bytes: 100 << 20,
            timeout: Duration::from_secs(20),
            plain_http: Vec::new(),
            extra_ca_pem: None,
            cache_dir: cache.path().to_owned(),
            cache_bytes: 1 << 30,
        })
        .expect("puller"),
    );
    let image = format!("{}/wasm/add:1", registry.host);
    let error = runtime()
        .block_on(puller.resolve(&image, &RegistryLogins::default()))
        .expect_err("an HTTPS pull from a plain-HTTP registry");
    let text = error.to_string();
    assert!(
        text.contains("answered in plain HTTP")
            && text.contains(&format!("--registry-plain-http {}", registry.host)),
        "{text}"
    );
}
