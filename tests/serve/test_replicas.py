"""What `specdec serve --replicas` asks of Ray Serve (specdec.serve.replicas), and the per-replica
/metrics page (specdec.serve.metrics.merge_replicas): no Ray needed."""

from __future__ import annotations

import pytest

from specdec.errors import SpecdecError
from specdec.runtime.loading import check_config
from specdec.serve.metrics import Metrics, merge_replicas
from specdec.serve.replicas import EngineSpec, ReplicaPlan, check_fits, deployment_options, parse_replicas
from tests.serve.conftest import metric_samples


@pytest.mark.parametrize("text, plan", [
    ("2", ReplicaPlan(2, 2)), (" 3 ", ReplicaPlan(3, 3)), ("1-4", ReplicaPlan(1, 4)), ("2 - 2", ReplicaPlan(2, 2)),
])
def test_parse_replicas(text, plan):
    assert parse_replicas(text) == plan


@pytest.mark.parametrize("text", ["", "0", "x", "-2", "2-", "3-1", "1.5", "1-2-3"])
def test_parse_replicas_refuses(text):
    with pytest.raises(SpecdecError, match="--replicas"):
        parse_replicas(text)


def test_a_fixed_count_and_the_batch_size():
    options = deployment_options(parse_replicas("3", cpus=0.5), max_batch=4, max_queue=16)
    assert options == {"num_replicas": 3, "max_ongoing_requests": 4, "max_queued_requests": 16,
                       "ray_actor_options": {"num_cpus": 0.5}}


def test_a_range_autoscales_on_ongoing_requests():
    options = deployment_options(parse_replicas("1-4"), max_batch=2, max_queue=8)
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 4,
                                             "target_ongoing_requests": 2}
    assert options["max_ongoing_requests"] == 2


def test_check_fits():
    check_fits(parse_replicas("2", cpus=1), 2)
    check_fits(parse_replicas("4", cpus=0.5), 2)
    with pytest.raises(SpecdecError, match="need 3 CPUs, and this machine has 2.*--replica-cpus 0.666667"):
        check_fits(parse_replicas("1-3", cpus=1), 2)


def test_engine_spec_checks_names_without_loading(tiny_dirs):
    check_config(EngineSpec(tiny_dirs["target"], "lookup+" + tiny_dirs["draft"]))
    check_config(EngineSpec(tiny_dirs["target"], "lookup"))
    with pytest.raises(SpecdecError, match="no-such-draft"):
        check_config(EngineSpec(tiny_dirs["target"], "lookup+no-such-draft"))
    with pytest.raises(SpecdecError, match="no-such-target"):
        check_config(EngineSpec("no-such-target", tiny_dirs["draft"]))


def test_merged_metrics_label_every_sample_with_its_replica():
    one, two = Metrics(lambda: 1.0, lambda: 0.0), Metrics(lambda: 0.0, lambda: 2.0)
    one.requests.labels(endpoint="/v1/completions", code="200").inc(3)
    two.requests.labels(endpoint="/v1/completions", code="200").inc(2)
    two.ttft.observe(0.3)
    page = merge_replicas({"a": one.render(), "b": two.render()}).decode()
    assert page.count("# TYPE specdec:requests_total counter") == 1
    samples = metric_samples(page)
    key = lambda name, **labels: (name, tuple(sorted(labels.items())))  # noqa: E731
    assert samples[key("specdec:requests_total", endpoint="/v1/completions", code="200", replica="a")] == 3
    assert samples[key("specdec:requests_total", endpoint="/v1/completions", code="200", replica="b")] == 2
    assert samples[key("specdec:num_requests_running", replica="a")] == 1
    assert samples[key("specdec:num_requests_waiting", replica="b")] == 2
    assert samples[key("specdec:time_to_first_token_seconds_count", replica="b")] == 1
    assert samples[key("specdec:time_to_first_token_seconds_bucket", le="0.5", replica="b")] == 1
    assert all(dict(labels).get("replica") in ("a", "b") for _, labels in samples)
