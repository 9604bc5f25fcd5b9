//! A version rollout as one request meets it, wire-free: which version an unpinned request goes to
//! (sidecar/serving/routing.py's split and fallback) and how a shadow call's answer differs from
//! the served one (sidecar/serving/rollouts.py's `compare_answers`). The rollout's decisions (its
//! steps, aborts, promotion) stay Python's: they are taken on the evidence the lanes send up.

use std::collections::{BTreeMap, HashMap};

use blake2::digest::{Update, VariableOutput};
use blake2::Blake2bVar;

use crate::golden::compare::{self, Element, Elements, Expected, Received};
use crate::protocol::answers::{self, NotV2, Values};

/// How far apart two versions' numbers may be and still be the same answer: `atol + rtol × |stable's|`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    pub atol: f64,
    pub rtol: f64,
}

/// One model's rollout as Python published it (sidecar.serving.rollouts.Rollout now): republished
/// at every change of its state or step, so a request reads the share of the moment.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub stable: String,
    pub candidate: String,
    /// The candidate's share of unpinned traffic now (0 while gating or aborted, 1 once promoted).
    pub share: f64,
    /// The request header whose value picks the version, lower-cased; "" for a uniform draw.
    pub cohort_key: String,
    /// The share of served answers also sent to the other version; 0 unless the rollout is
    /// progressing (the gate must pass before the candidate sees a live request, even a shadow).
    pub shadow_rate: f64,
    /// For each of the two versions, the trusted version its unpinned requests go to while it is not
    /// trusted (routing.fallback_version, Python's rule); absent: none, admission judges the pick.
    pub fallbacks: HashMap<String, String>,
    /// The rollout's `compare` tolerance, and `compare_outputs` by output name.
    pub tolerance: Tolerance,
    pub tolerances: HashMap<String, Tolerance>,
}

impl Route {
    /// The version for an unpinned request at `bucket` in [0, 1) (Rollout.pick).
    pub fn pick(&self, bucket: f64) -> &str {
        if bucket < self.share {
            &self.candidate
        } else {
            &self.stable
        }
    }

    /// The rollout's other version ("" for a version that is neither): where a shadow goes.
    pub fn other(&self, version: &str) -> &str {
        if version == self.stable {
            &self.candidate
        } else if version == self.candidate {
            &self.stable
        } else {
            ""
        }
    }

    /// The fallback of `version` while it is not trusted, "" for none.
    pub fn fallback(&self, version: &str) -> &str {
        self.fallbacks.get(version).map(String::as_str).unwrap_or("")
    }

    pub fn tolerance(&self, output: &str) -> Tolerance {
        self.tolerances.get(output).copied().unwrap_or(self.tolerance)
    }
}

/// A stable position in [0, 1) for one user of one model: the same value, the same version, at
/// every step (routing.cohort_bucket: BLAKE2b of `model\0value` with an 8-byte digest, big-endian,
/// over 2^64).
pub fn cohort_bucket(model: &str, value: &str) -> f64 {
    let mut digest = [0u8; 8];
    let Ok(mut hasher) = Blake2bVar::new(digest.len()) else { return 0.0 };
    hasher.update(model.as_bytes());
    hasher.update(&[0]);
    hasher.update(value.as_bytes());
    if hasher.finalize_variable(&mut digest).is_err() {
        return 0.0;
    }
    u64::from_be_bytes(digest) as f64 / 18_446_744_073_709_551_616.0
}

/// One output's values as a comparison reads them.
#[derive(Debug, Clone, PartialEq)]
pub enum Elementwise {
    Numbers(Vec<f64>),
    Bytes(Vec<Element>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub datatype: String,
    pub shape: Vec<i64>,
    pub values: Elementwise,
}

/// A 200 answer's outputs by name (sorted, as the Python rule walks them; a name twice keeps its last).
pub type Outputs = BTreeMap<String, Tensor>;

/// Decode a 200 infer answer (JSON, or a JSON header and binary sections) for comparing.
pub fn decode_outputs(body: &[u8], header_length: Option<i64>) -> Result<Outputs, NotV2> {
    let answer = answers::decode(body, header_length)?;
    let mut outputs = Outputs::new();
    for output in answer.outputs {
        let values = if output.datatype == "BYTES" {
            Elementwise::Bytes(match &output.values {
                Values::Binary { start, end } => {
                    answers::bytes_elements(&body[*start..*end])?.into_iter().map(Element::binary).collect()
                }
                Values::Texts(texts) => texts.iter().map(|t| Element::text(t)).collect(),
                Values::Numbers { .. } => return Err(NotV2(format!("BYTES output {} holds numbers", output.name))),
            })
        } else {
            Elementwise::Numbers(answers::numbers_as_f64(&output.datatype, &output.values, body)?)
        };
        outputs.insert(output.name, Tensor { datatype: output.datatype, shape: output.shape, values });
    }
    Ok(outputs)
}

/// Does a float output hold NaN or ±Inf (core._non_finite: the shadow's answer counts as an error)?
pub fn non_finite(outputs: &Outputs) -> bool {
    outputs.values().any(|t| {
        t.datatype.starts_with("FP")
            && matches!(&t.values, Elementwise::Numbers(values) if values.iter().any(|v| !v.is_finite()))
    })
}

/// Every way the candidate's outputs differ from stable's, as (output, message): an output on one
/// side only, then each common output's datatype, shape, values and NaN with the rollout's
/// tolerances (the golden rule, golden/compare.rs), stable's answer the expected side.
pub fn compare_answers(stable: &Outputs, candidate: &Outputs, route: &Route) -> Vec<(String, String)> {
    let mut mismatches = Vec::new();
    let mut only: Vec<(&String, &str)> = stable
        .keys()
        .filter(|name| !candidate.contains_key(*name))
        .map(|name| (name, "one"))
        .chain(candidate.keys().filter(|name| !stable.contains_key(*name)).map(|name| (name, "two")))
        .collect();
    only.sort();
    for (name, side) in only {
        mismatches.push((name.clone(), format!("output {name} only in version {side}'s answer")));
    }
    for (name, want) in stable {
        let Some(got) = candidate.get(name) else { continue };
        let tolerance = route.tolerance(name);
        let expected_values = match &want.values {
            Elementwise::Numbers(v) => Elements::Numbers(v),
            Elementwise::Bytes(v) => Elements::Bytes(v),
        };
        let expected = Expected {
            datatype: &want.datatype,
            shape: &want.shape,
            values: expected_values,
            atol: tolerance.atol,
            rtol: tolerance.rtol,
        };
        let got_values = match &got.values {
            Elementwise::Numbers(v) => Elements::Numbers(v),
            Elementwise::Bytes(v) => Elements::Bytes(v),
        };
        let received = Received { datatype: &got.datatype, shape: &got.shape, values: got_values };
        match compare::compare_output(name, &expected, Some(&received)) {
            Ok(messages) => mismatches.extend(messages.into_iter().map(|m| (name.clone(), m))),
            // The values disagree with their own shape: not comparable, so not the same answer.
            Err(e) => mismatches.push((name.clone(), format!("{name}: {e}"))),
        }
    }
    mismatches
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route() -> Route {
        Route {
            stable: "1".into(),
            candidate: "2".into(),
            share: 0.3,
            cohort_key: String::new(),
            shadow_rate: 1.0,
            fallbacks: HashMap::from([("2".to_owned(), "1".to_owned())]),
            tolerance: Tolerance { atol: 1e-6, rtol: 0.0 },
            tolerances: HashMap::from([("loose".to_owned(), Tolerance { atol: 0.5, rtol: 0.0 })]),
        }
    }

    #[test]
    fn a_cohort_bucket_is_python_s_blake2b_of_eight_bytes() {
        // hashlib.blake2b(f"{model}\0{value}".encode(), digest_size=8), big-endian / 2**64.
        assert_eq!(cohort_bucket("m", "user-1"), 0.3371063520004953);
        assert_eq!(cohort_bucket("credit_risk", "alice"), 0.37148560442038);
        assert_eq!(cohort_bucket("", ""), 0.5818916442384907);
    }

    #[test]
    fn a_bucket_below_the_share_goes_to_the_candidate_and_the_rest_to_stable() {
        let r = route();
        assert_eq!(r.pick(0.0), "2");
        assert_eq!(r.pick(0.299), "2");
        assert_eq!(r.pick(0.3), "1");
        assert_eq!((r.other("1"), r.other("2"), r.other("3")), ("2", "1", ""));
        assert_eq!((r.fallback("2"), r.fallback("1")), ("1", ""));
    }

    fn outputs(body: &str) -> Outputs {
        decode_outputs(body.as_bytes(), None).expect("a v2 answer")
    }

    #[test]
    fn two_answers_differ_by_output_presence_values_and_nan_with_each_output_s_tolerance() {
        let r = route();
        let stable = outputs(
            r#"{"outputs":[{"name":"scores","datatype":"FP32","shape":[1],"data":[0.5]},
                           {"name":"loose","datatype":"FP32","shape":[1],"data":[1.0]},
                           {"name":"gone","datatype":"FP32","shape":[1],"data":[1.0]}]}"#,
        );
        let same = outputs(
            r#"{"outputs":[{"name":"scores","datatype":"FP32","shape":[1],"data":[0.5]},
                           {"name":"loose","datatype":"FP32","shape":[1],"data":[1.4]},
                           {"name":"gone","datatype":"FP32","shape":[1],"data":[1.0]}]}"#,
        );
        assert!(compare_answers(&stable, &same, &r).is_empty(), "within loose's own tolerance");
        let other = outputs(
            r#"{"outputs":[{"name":"scores","datatype":"FP32","shape":[1],"data":[0.7]},
                           {"name":"loose","datatype":"FP32","shape":[1],"data":[1.0]},
                           {"name":"extra","datatype":"FP32","shape":[1],"data":[1.0]}]}"#,
        );
        let found = compare_answers(&stable, &other, &r);
        let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["extra", "gone", "scores"]);
        assert_eq!(found[0].1, "output extra only in version two's answer");
        assert_eq!(found[1].1, "output gone only in version one's answer");
        assert!(found[2].1.starts_with("scores[0] expected"), "{}", found[2].1);
        assert!(!non_finite(&other));
    }

    #[test]
    fn nan_in_a_float_output_is_seen_and_bytes_are_compared_as_bytes() {
        // JSON has no NaN: the binary form carries it.
        let header = r#"{"outputs":[{"name":"s","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":4}}]}"#;
        let mut body = header.as_bytes().to_vec();
        body.extend_from_slice(&f32::NAN.to_le_bytes());
        let nan = decode_outputs(&body, Some(header.len() as i64)).expect("binary answer");
        assert!(non_finite(&nan));
        let a = outputs(r#"{"outputs":[{"name":"t","datatype":"BYTES","shape":[1],"data":["alpha"]}]}"#);
        let b = outputs(r#"{"outputs":[{"name":"t","datatype":"BYTES","shape":[1],"data":["ahpla"]}]}"#);
        assert!(compare_answers(&a, &a, &route()).is_empty());
        assert_eq!(compare_answers(&a, &b, &route()).len(), 1);
        assert!(!non_finite(&a));
    }
}
