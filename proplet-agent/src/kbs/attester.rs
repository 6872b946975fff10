//! Evidence for the Key Broker Service: what a TEE attester signs over the exchange's
//! `report_data` (the hash binding the KBS's nonce to the device's ephemeral key).

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use kbs_types::Tee;
use serde_json::{json, Value};

use crate::config::AttesterChoice;

/// A source of attestation evidence.
pub trait Attester: Send + Sync {
    /// The TEE type the KBS is told.
    fn tee(&self) -> Tee;
    /// The attester's name, as the agent announces it (`attester` in its discovery).
    fn name(&self) -> &'static str;
    /// Evidence over `report_data`.
    fn evidence(&self, report_data: &[u8]) -> Value;
}

/// Confidential Containers' `sample` TEE: evidence any process can make. The KBS's `sample`
/// verifier checks only that it carries the right `report_data`, so it proves nothing
/// about the device: for tests and development without TEE hardware.
pub struct SampleAttester;

impl Attester for SampleAttester {
    fn tee(&self) -> Tee {
        Tee::Sample
    }

    fn name(&self) -> &'static str {
        "sample"
    }

    fn evidence(&self, report_data: &[u8]) -> Value {
        json!({"svn": "1", "report_data": BASE64.encode(report_data)})
    }
}

/// TEE guest devices whose attesters this proplet does not have: found, they are named in
/// the warning that says encrypted tasks will not be taken.
const TEE_DEVICES: [(&str, &str); 3] = [
    ("/dev/sev-guest", "AMD SEV-SNP"),
    ("/dev/tdx_guest", "Intel TDX"),
    ("/dev/tdx-guest", "Intel TDX"),
];

/// The TEE hardware this device shows, if any.
pub fn detected_tee() -> Option<&'static str> {
    TEE_DEVICES
        .iter()
        .find(|(path, _)| std::path::Path::new(path).exists())
        .map(|(_, name)| *name)
}

/// The attester `choice` names, if it names one.
pub fn for_choice(choice: AttesterChoice) -> Option<Box<dyn Attester>> {
    match choice {
        AttesterChoice::None => None,
        AttesterChoice::Sample => Some(Box::new(SampleAttester)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_evidence_carries_the_report_data_in_standard_base64() {
        let evidence = SampleAttester.evidence(&[0xfb; 48]);
        assert_eq!(evidence["svn"], "1");
        let text = evidence["report_data"].as_str().unwrap();
        assert_eq!(BASE64.decode(text).unwrap(), vec![0xfb; 48]);
        assert!(
            text.contains('+') || text.contains('/'),
            "standard, not url-safe: {text}"
        );
    }
}
