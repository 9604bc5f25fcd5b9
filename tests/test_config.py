"""The configuration: defaults, file, environment overrides, and one clear line for each mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.config import ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sidecar.yaml"
    path.write_text(text)
    return path


def test_every_key_has_a_default():
    config = load_config(None, environ={})
    assert config.triton.url == "http://127.0.0.1:8000"
    assert (config.listen.host, config.listen.port) == ("0.0.0.0", 8080)
    assert config.golden_dir == Path("golden_requests") and config.models == ()
    assert (config.probes.interval_s, config.probes.timeout_s) == (5.0, 2.0)
    assert (config.probes.failure_threshold, config.probes.success_threshold) == (3, 1)
    assert config.healing.enabled and config.healing.max_attempts == 3


@pytest.mark.parametrize("path", ["sidecar.example.yaml", "examples/sidecar.demo.yaml"])
def test_shipped_config_files_are_valid(path):
    config = load_config(REPO / path, environ={})
    assert config.source.endswith(path)


def test_environment_overrides_the_file(tmp_path):
    path = _file(tmp_path, "probes:\n  interval_s: 2\n")
    config = load_config(path, environ={
        "SIDECAR_TRITON_URL": "http://127.0.0.1:9000",
        "SIDECAR_PROBES_INTERVAL_S": "0.5",
        "SIDECAR_HEALING_ENABLED": "false",
        "SIDECAR_MODELS": "a, b",
        "SIDECAR_GOLDEN_DIR": "/etc/golden",
        "SIDECAR_TRITON_REPOSITORY_TOKEN": "0123456789",
        "SIDECAR_SERVICE_HOST": "10.0.0.1",  # injected by Kubernetes for a Service called "sidecar"
    })
    assert config.triton.url == "http://127.0.0.1:9000"
    assert config.probes.interval_s == 0.5
    assert config.healing.enabled is False
    assert config.models == ("a", "b")
    assert config.golden_dir == Path("/etc/golden")
    assert config.triton.repository_token == "0123456789"  # digits stay a string
    assert "0123456789" not in repr(config)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("probes:\n  intervall_s: 1\n", "unknown key 'probes.intervall_s'"),
        ("tritonn:\n  url: x\n", "unknown key 'tritonn'"),
        ("probes:\n  interval_s: fast\n", "key 'probes.interval_s': 'fast' is not of type 'number'"),
        ("probes:\n  failure_threshold: 0\n", "key 'probes.failure_threshold': 0 is less than the minimum of 1"),
        ("listen:\n  port: 70000\n", "key 'listen.port': 70000 is greater than the maximum of 65535"),
        ("triton:\n  url: 127.0.0.1:8000\n", "key 'triton.url'"),
        ("healing:\n  backoff_initial_s: 60\n  backoff_max_s: 5\n", "'healing.backoff_initial_s' must not exceed"),
        ("filtering:\n  rules:\n  - {model: 'credit(', drop_outputs: [x]}\n",
         "key 'filtering.rules.0.model': not a regular expression"),
        ("logging:\n  format: xml\n", "key 'logging.format'"),
        ("listen:\n  event_loop: tokio\n", "key 'listen.event_loop'"),
        ("rollouts:\n  m: {stable: '1'}\n", "key 'rollouts.m': 'candidate' is a required property"),
        ("rollouts:\n  m: {stable: '1', candidate: '1'}\n", "key 'rollouts.m.candidate': must differ from stable"),
        ("rollouts:\n  m: {stable: '1', candidate: '2', steps: [0.5, 0.1]}\n",
         "key 'rollouts.m.steps': shares must increase"),
        ("rollouts:\n  m: {stable: '1', candidate: '2', shadow_rate: 1.5}\n",
         "key 'rollouts.m.shadow_rate': 1.5 is greater than the maximum of 1"),
        ("rollouts:\n  m: {stable: '1', candidate: '2', stpes: [1.0]}\n", "unknown key 'rollouts.m.stpes'"),
        ("rollouts:\n  m: {stable: '1', candidate: '2', decision: rollback}\n", "key 'rollouts.m.decision'"),
        ("proxy:\n  hold_while_suspect_ms: -1\n", "key 'proxy.hold_while_suspect_ms': -1 is less than the minimum"),
        ("- just\n- a list\n", "the top level must be a mapping"),
        ("probes: [\n", "not valid YAML (line"),
    ],
)
def test_a_bad_config_file_is_one_line_naming_the_file_and_key(tmp_path, text, expected):
    path = _file(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path, environ={})
    message = str(e.value)
    assert message.startswith(f"{path}: ")
    assert expected in message
    assert "\n" not in message


def test_a_rollout_takes_the_keys_issue_20_names(tmp_path):
    path = _file(tmp_path, """
rollouts:
  credit_risk:
    stable: "1"
    candidate: "2"
    steps: [0.001, 0.05, 0.3, 1.0]
    step_min_requests: 200
    step_min_s: 60
    shadow_rate: 0.05
    compare: {atol: 1.0e-5, rtol: 1.0e-4, outputs: {scores: {atol: 0.01, rtol: 0}}}
    max_diff_rate: 0.005
    max_error_rate: 0.001
    max_p99_increase: 0.10
    cohort_key: "x-user"
""")
    rollout = load_config(path, environ={}).rollouts["credit_risk"]
    assert (rollout.stable, rollout.candidate, rollout.steps) == ("1", "2", (0.001, 0.05, 0.3, 1.0))
    assert (rollout.step_min_requests, rollout.step_min_s, rollout.shadow_rate) == (200, 60, 0.05)
    assert (rollout.max_diff_rate, rollout.max_error_rate, rollout.max_p99_increase) == (0.005, 0.001, 0.10)
    assert rollout.tolerance("income_prob").atol == 1.0e-5 and rollout.tolerance("scores").atol == 0.01
    assert (rollout.cohort_key, rollout.decision) == ("x-user", "auto")


def test_a_bad_environment_override_names_the_variable_or_key():
    with pytest.raises(ConfigError, match=r"SIDECAR_PROBES_INTERVALL_S: unknown key probes\.intervall_s"):
        load_config(None, environ={"SIDECAR_PROBES_INTERVALL_S": "1"})
    with pytest.raises(ConfigError, match=r"key 'probes\.interval_s': -1 is less than or equal to the minimum of 0"):
        load_config(None, environ={"SIDECAR_PROBES_INTERVAL_S": "-1"})


def test_a_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "nope.yaml", environ={})


def test_config_is_frozen():
    config = load_config(None, environ={})
    with pytest.raises(AttributeError):
        config.probes.interval_s = 1  # type: ignore[misc]


def test_the_rust_grpc_front_serves_tls_needs_the_rust_http_front_and_is_the_default(tmp_path):
    assert load_config(None, environ={}).listen.grpc_front == "rust"
    # The Python listener keeps grpcio on the gRPC port unless the file says otherwise.
    assert load_config(_file(tmp_path, "listen:\n  front: python\n"), environ={}).listen.grpc_front == "python"
    assert load_config(None, environ={"SIDECAR_LISTEN_FRONT": "python"}).listen.grpc_front == "python"
    explicit = _file(tmp_path, "listen:\n  front: python\n  grpc_front: python\n")
    assert load_config(explicit, environ={}).listen.grpc_front == "python"
    # grpcs on the Rust gRPC front (issue 31, deliverable 4): tls.cert_file is no longer refused with it.
    tls = _file(tmp_path, "listen:\n  grpc_front: rust\ntls:\n  cert_file: c.pem\n  key_file: k.pem\n")
    config = load_config(tls, environ={})
    assert config.listen.grpc_front == "rust" and config.tls.cert_file == "c.pem"
    python = _file(tmp_path, "listen:\n  grpc_front: rust\n  front: python\n")
    with pytest.raises(ConfigError, match=r"key 'listen\.grpc_front': rust runs on the Rust HTTP front's runtime"):
        load_config(python, environ={})
    python_tls = _file(tmp_path, "listen:\n  grpc_front: rust\n  front: python\n"
                                 "tls:\n  cert_file: c.pem\n  key_file: k.pem\n")
    with pytest.raises(ConfigError, match=r"key 'listen\.grpc_front': rust runs on the Rust HTTP front's runtime"):
        load_config(python_tls, environ={})
    assert load_config(None, environ={"SIDECAR_LISTEN_GRPC_FRONT": "rust"}).listen.grpc_front == "rust"
    # No gRPC port: nothing for it to serve, nothing to refuse.
    none = _file(tmp_path, "listen:\n  grpc_front: rust\n  grpc_port: 0\n  front: python\n")
    assert load_config(none, environ={}).listen.grpc_front == "rust"
