//! Which filters each SUBSCRIBE carried, so a SUBACK that refuses some of them is answered by
//! subscribing again to those alone. Subscribing again to a filter the broker already holds
//! is not free: on NATS it goes through the JetStream consumer behind a QoS 1 subscription
//! again, which on a cluster missing a node can itself be refused (each after 4 s); an agent
//! that subscribed again to all its filters on every refusal was seen never to settle, and to
//! miss its rotated key.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;

use propeller_broker::protocol::refused_filters;
use rumqttc::{AsyncClient, QoS, SubscribeFilter, SubscribeReasonCode};

/// The SUBSCRIBE requests on their way to the broker, paired with their packet ids as the
/// event loop sends them.
#[derive(Default)]
pub struct Subscriptions {
    /// Filters of each request handed to the client and not yet seen going out, in order,
    /// and whether the request is optional.
    queued: Mutex<VecDeque<(Vec<String>, bool)>>,
    /// Filters of each SUBSCRIBE sent and not yet acknowledged, by packet id, and whether
    /// it is optional.
    sent: Mutex<HashMap<u16, (Vec<String>, bool)>>,
    /// Filters the broker refused and has not accepted since.
    refused: Mutex<HashSet<String>>,
}

impl Subscriptions {
    /// Asks `client` to subscribe to `filters` in one SUBSCRIBE; false if its request queue
    /// is full (the caller tries again later).
    pub fn request(&self, client: &AsyncClient, filters: Vec<(String, QoS)>) -> bool {
        self.ask(client, filters, false)
    }

    /// [`Subscriptions::request`] for filters the agent can run without (a broker, or an
    /// older propeller, that does not offer them): a refusal is not retried and does not
    /// keep the subscriptions from being complete.
    pub fn request_optional(&self, client: &AsyncClient, filters: Vec<(String, QoS)>) -> bool {
        self.ask(client, filters, true)
    }

    fn ask(&self, client: &AsyncClient, filters: Vec<(String, QoS)>, optional: bool) -> bool {
        if filters.is_empty() {
            return true;
        }
        // The queue and the client's channel change together, so the order of `queued` is
        // the order the event loop sends them in.
        let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        let names = filters.iter().map(|(f, _)| f.clone()).collect();
        let packet = filters
            .into_iter()
            .map(|(path, qos)| SubscribeFilter::new(path, qos));
        match client.try_subscribe_many(packet) {
            Ok(()) => {
                queued.push_back((names, optional));
                true
            }
            Err(_) => false,
        }
    }

    /// The event loop sent the next queued SUBSCRIBE as packet `pkid`.
    pub fn sent(&self, pkid: u16) {
        let next = self
            .queued
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front();
        if let Some(filters) = next {
            self.sent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(pkid, filters);
        }
    }

    /// The filters a SUBACK refused that must be asked for again (none for an optional
    /// request); `None` when the SUBACK matches no request known here (the caller
    /// subscribes to everything again).
    pub fn refused(&self, pkid: u16, codes: &[SubscribeReasonCode]) -> Option<Vec<String>> {
        let (filters, optional) = self
            .sent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&pkid)?;
        let refusals: Vec<bool> = codes
            .iter()
            .map(|code| matches!(code, SubscribeReasonCode::Failure))
            .collect();
        let refused = refused_filters(&filters, &refusals)?;
        if optional {
            return Some(Vec::new());
        }
        let mut outstanding = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        for filter in &filters {
            outstanding.remove(filter);
        }
        outstanding.extend(refused.iter().cloned());
        Some(refused)
    }

    /// Whether every filter asked for is acknowledged by the broker: nothing queued, nothing
    /// waiting for its SUBACK, nothing refused and not yet accepted since.
    pub fn complete(&self) -> bool {
        self.queued
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
            && self
                .sent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
            && self
                .refused
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
    }

    /// The connection is gone with every request not yet acknowledged (a clean session
    /// starts without them): call together with `EventLoop::clean`.
    pub fn forget(&self) {
        let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        queued.clear();
        self.sent.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rumqttc::MqttOptions;

    fn client() -> (AsyncClient, rumqttc::EventLoop) {
        AsyncClient::new(MqttOptions::new("t", "127.0.0.1", 1), 8)
    }

    #[test]
    fn a_suback_names_the_filters_it_refused() {
        let (client, _events) = client();
        let subs = Subscriptions::default();
        assert!(subs.request(
            &client,
            vec![
                ("a".into(), QoS::AtLeastOnce),
                ("b".into(), QoS::AtLeastOnce)
            ]
        ));
        assert!(subs.request(&client, vec![("k".into(), QoS::AtLeastOnce)]));
        subs.sent(7);
        subs.sent(8);
        let codes = [
            SubscribeReasonCode::Success(QoS::AtLeastOnce),
            SubscribeReasonCode::Failure,
        ];
        assert_eq!(subs.refused(7, &codes), Some(vec!["b".to_owned()]));
        assert_eq!(
            subs.refused(8, &[SubscribeReasonCode::Success(QoS::AtLeastOnce)]),
            Some(vec![])
        );
        // Unknown or already answered packet ids are not guessed at.
        assert_eq!(subs.refused(7, &codes), None);
    }

    #[test]
    fn subscriptions_are_complete_once_every_refused_filter_is_accepted() {
        let (client, _events) = client();
        let subs = Subscriptions::default();
        let ok = SubscribeReasonCode::Success(QoS::AtLeastOnce);
        let ask = |names: &[&str]| {
            let filters = names
                .iter()
                .map(|n| ((*n).to_owned(), QoS::AtLeastOnce))
                .collect();
            assert!(subs.request(&client, filters));
        };
        ask(&["a", "b"]);
        assert!(!subs.complete(), "queued");
        subs.sent(1);
        assert!(!subs.complete(), "waiting for its SUBACK");
        subs.refused(1, &[ok, SubscribeReasonCode::Failure]);
        assert!(!subs.complete(), "b refused and not asked again yet");
        ask(&["b"]);
        subs.sent(2);
        subs.refused(2, &[SubscribeReasonCode::Failure]);
        assert!(!subs.complete(), "b refused again");
        ask(&["b"]);
        subs.sent(3);
        subs.refused(3, &[ok]);
        assert!(subs.complete());
    }

    #[test]
    fn a_refused_optional_filter_is_not_asked_again_and_leaves_them_complete() {
        let (client, _events) = client();
        let subs = Subscriptions::default();
        assert!(subs.request(&client, vec![("a".into(), QoS::AtLeastOnce)]));
        assert!(subs.request_optional(&client, vec![("u".into(), QoS::AtLeastOnce)]));
        subs.sent(1);
        subs.sent(2);
        let ok = SubscribeReasonCode::Success(QoS::AtLeastOnce);
        assert_eq!(subs.refused(1, &[ok]), Some(vec![]));
        assert!(!subs.complete(), "the optional SUBACK is awaited");
        assert_eq!(
            subs.refused(2, &[SubscribeReasonCode::Failure]),
            Some(vec![])
        );
        assert!(subs.complete());
    }

    #[test]
    fn a_lost_connection_forgets_what_was_in_flight() {
        let (client, _events) = client();
        let subs = Subscriptions::default();
        assert!(subs.request(&client, vec![("a".into(), QoS::AtLeastOnce)]));
        subs.sent(1);
        assert!(subs.request(&client, vec![("b".into(), QoS::AtLeastOnce)]));
        subs.forget();
        assert!(subs.request(&client, vec![("c".into(), QoS::AtLeastOnce)]));
        subs.sent(1);
        assert_eq!(
            subs.refused(1, &[SubscribeReasonCode::Failure]),
            Some(vec!["c".to_owned()])
        );
    }
}
