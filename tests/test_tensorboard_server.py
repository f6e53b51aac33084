"""End to end: a real TensorBoard server serves what the callbacks wrote."""

import json
import subprocess
import sys
import time
import urllib.request

import keras
import numpy as np

from keras_safe_dist import SafeDistributedModel
from keras_safe_dist import callbacks
from keras_safe_dist.scale_out.launch import free_ports

from conftest import mirrored_strategy

SERVER_TIMEOUT_S = 90


def get_json(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return json.loads(response.read())


def wait_for(port, path, ready):
    deadline = time.monotonic() + SERVER_TIMEOUT_S
    last = None
    while time.monotonic() < deadline:
        try:
            last = get_json(port, path)
            if ready(last):
                return last
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"TensorBoard did not serve {path} in {SERVER_TIMEOUT_S}s; last answer: {last}")


def test_tensorboard_serves_the_dashboard_the_statistics_and_the_audit_tables(tmp_path):
    log_dir = str(tmp_path)
    with mirrored_strategy().scope():
        inputs = keras.Input((3,))
        model = SafeDistributedModel(inputs, keras.layers.Dense(1)(inputs), global_clipnorm=1.0)
        model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    model.fit(
        x, x[:, :1], batch_size=8, epochs=2, verbose=0,
        callbacks=[callbacks.AggregationAudit(log_dir=log_dir), callbacks.Dashboard(log_dir)],
    )
    (port,) = free_ports(1)
    server = subprocess.Popen(
        [
            sys.executable, "-m", "tensorboard.main", "--logdir", log_dir, "--host", "127.0.0.1",
            "--port", str(port), "--load_fast=false", "--reload_interval", "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        scalars = wait_for(
            port, "/data/plugin/scalars/tags", lambda tags: {".", "safe_distributed"} <= set(tags)
        )
        assert {"safe_distributed/grad_norm", "safe_distributed/clip_rate", "safe_distributed/skipped_updates",
                "safe_distributed/samples_per_update"} <= set(scalars["safe_distributed"])
        assert "audits/aggregation/error" in scalars["."]
        texts = wait_for(port, "/data/plugin/text/tags", lambda tags: "." in tags)
        assert "audits/aggregation" in texts["."]
        layout = wait_for(port, "/data/plugin/custom_scalars/layout", lambda data: data)
        category, updates = layout["category"]
        assert category["title"] == "safe distributed training"
        assert len(category["chart"]) == 4
        assert updates["title"] == "safe distributed training, per update"
        assert len(updates["chart"]) == 4
        series = get_json(
            port, "/data/plugin/scalars/scalars?run=safe_distributed&tag=safe_distributed/samples_per_update"
        )
        assert [(step, value) for _, step, value in series] == [(0, 8.0), (1, 8.0)]
        # Per update: 2 updates per epoch, on the update axis, with their description.
        tag = "safe_distributed/update/samples_per_update"
        series = get_json(port, f"/data/plugin/scalars/scalars?run=safe_distributed&tag={tag}")
        assert [(step, value) for _, step, value in series] == [(1, 8.0), (2, 8.0), (3, 8.0), (4, 8.0)]
        assert scalars["safe_distributed"][tag]["description"].startswith(
            "<p>Samples behind this update, all replicas and micro-batches together."
        )
    finally:
        server.kill()
        server.communicate(timeout=30)
