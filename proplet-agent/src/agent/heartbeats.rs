//! Liveness reports: heartbeats and the proplet's periodic metrics.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use propeller_broker::protocol::Heartbeat;

use super::Agent;

impl Agent {
    pub(super) async fn heartbeats(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.config.liveliness_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if !self.listening.load(Ordering::Relaxed) {
                continue;
            }
            let beat = Heartbeat {
                proplet_id: self.config.client_id.clone(),
                namespace: Some(self.config.namespace.clone()),
                metadata: Some(self.probe.metadata()),
                metrics: Some(self.probe.heartbeat_metrics()),
            };
            self.publish_now(self.channel.alive(), beat.encode()).await;
        }
    }

    pub(super) async fn proplet_metrics(self: Arc<Self>) {
        let Some(period) = self.config.metrics_interval else {
            return;
        };
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let metrics = self
                .probe
                .proplet_metrics(&self.config.client_id, &self.config.namespace);
            self.publish_now(self.channel.proplet_metrics(), metrics.encode())
                .await;
        }
    }
}
