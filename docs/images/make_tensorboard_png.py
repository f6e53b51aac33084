"""Takes docs/images/tensorboard.png: the Dashboard's charts in TensorBoard, in a real browser.

Serves a log directory (by default the one `make_report_plot.py` leaves,
logs/report_plot) with `tensorboard --host 127.0.0.1` on a free port, opens
its "Custom Scalars" tab in headless Chromium, driven over the DevTools
protocol on a pipe (no network port, standard library only), with the
settings the Dashboard's chart descriptions ask for (smoothing 0, "Ignore
outliers in chart scaling" off, the run `safe_distributed` alone), and saves
a 1280 x 900 screenshot. Both processes end with the script.

Needs `chromium` (Debian: `apt-get install -y chromium`) and the tensorboard
package. Run, from the repository's root, after make_report_plot.py
(about 20 s):
    PYTHONPATH=. python3 docs/images/make_tensorboard_png.py [--log-dir DIR] [--out FILE]
"""

import argparse
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
WIDTH, HEIGHT = 1280, 900
# TensorBoard keeps "Ignore outliers" in the page's localStorage; smoothing
# and the run filter are read from the URL.
SETTINGS = {"_ignoreYOutliers": "false"}
FRAGMENT = "#custom_scalars&_smoothingWeight=0&regexInput=safe_distributed"
SETTLE_S = 8  # for the charts to fetch their points and draw


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_server(url, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.read()
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"TensorBoard did not answer {url} within {timeout} s")


class Browser:
    """Headless Chromium driven over `--remote-debugging-pipe` (fd 3 in, fd 4 out)."""

    def __init__(self, profile):
        to_chrome, self._send = os.pipe()
        self._receive, from_chrome = os.pipe()
        os.set_inheritable(to_chrome, True)
        os.set_inheritable(from_chrome, True)
        # The child's fds 3 and 4: dup'ed there by a tiny shell.
        command = [
            "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--remote-debugging-pipe", f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}",
        ]
        self.process = subprocess.Popen(
            ["sh", "-c", f'exec 3<&{to_chrome} 4>&{from_chrome}; exec "$@"', "sh", *command],
            pass_fds=(to_chrome, from_chrome), stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome)
        os.close(from_chrome)
        self._buffer = b""
        self._id = 0

    def call(self, method, session=None, **params):
        """Sends one command and returns its result (events on the way are dropped)."""
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._send, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._receive, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium closed the pipe during {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def close(self):
        try:
            self.call("Browser.close")
        except RuntimeError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def screenshot(url, out):
    profile = tempfile.mkdtemp(prefix="ksd-chromium-")
    browser = Browser(profile)
    try:
        target = browser.call("Target.createTarget", url="about:blank")["targetId"]
        session = browser.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        browser.call("Emulation.setDeviceMetricsOverride", session, width=WIDTH, height=HEIGHT,
                     deviceScaleFactor=1, mobile=False)
        # The origin's localStorage first, then the page that reads it.
        browser.call("Page.navigate", session, url=url)
        time.sleep(2)
        script = "".join(f"localStorage.setItem({k!r}, {v!r});" for k, v in SETTINGS.items())
        browser.call("Runtime.evaluate", session, expression=script)
        browser.call("Page.reload", session)
        time.sleep(SETTLE_S)
        data = browser.call("Page.captureScreenshot", session, format="png")["data"]
    finally:
        browser.close()
        shutil.rmtree(profile, ignore_errors=True)
    with open(out, "wb") as f:
        f.write(base64.b64decode(data))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default=os.path.join("logs", "report_plot"),
                        help="the log directory served (default logs/report_plot)")
    parser.add_argument("--out", default=os.path.relpath(os.path.join(HERE, "tensorboard.png")),
                        help="the screenshot (default docs/images/tensorboard.png)")
    args = parser.parse_args()
    if not os.path.isdir(args.log_dir):
        sys.exit(f"no log directory at {args.log_dir}: run docs/images/make_report_plot.py first")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", args.log_dir, "--host", "127.0.0.1",
         "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_server(f"{base}/data/runs")
        screenshot(f"{base}/{FRAGMENT}", args.out)
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
