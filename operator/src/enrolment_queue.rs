//! The queue between the broker's enrolment requests and the worker that answers them
//! ([`crate::enrolment::start`]): a request is queued, never answered from the MQTT callback.

use propeller_broker::protocol::enrolment::EnrolRequest;
use propeller_broker::server::{BrokerEvent, EventKind};
use tokio::sync::mpsc::UnboundedSender;

/// One request waiting for its answer.
pub struct Pending {
    /// The enrolment login that asked.
    pub client_id: String,
    /// The request, or why it could not be read.
    pub request: Result<Box<EnrolRequest>, String>,
}

/// The queue of enrolment requests, held by the driver.
pub struct Enrolments {
    queue: UnboundedSender<Pending>,
    /// The namespace bootstrap token Secrets are kept in.
    pub token_namespace: String,
}

impl Enrolments {
    /// A queue feeding `queue`, for tokens kept in `token_namespace`.
    pub fn new(queue: UnboundedSender<Pending>, token_namespace: String) -> Self {
        Self {
            queue,
            token_namespace,
        }
    }

    /// Queues `event` if it is an enrolment request; `false` when it is something else.
    pub fn submit(&self, event: &BrokerEvent) -> bool {
        let EventKind::EnrolmentRequest(request) = &event.kind else {
            return false;
        };
        let _ = self.queue.send(Pending {
            client_id: event.client_id.clone(),
            request: request.clone(),
        });
        true
    }
}
