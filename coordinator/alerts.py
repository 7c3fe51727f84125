"""The decision core's ``Alert`` actions, sent to an operator's webhook (``--alert-webhook``) besides the log.

Each alert is one JSON POST (``{"alert_id", "message", "task", "node", "ts", "cluster"}``) made by
the notifier's own thread: the decision loop only puts it on a bounded queue and never waits for the
network. A POST that fails (no answer, or a status other than 2xx; a redirect is not followed) is retried with backoff
``retries`` times, then counted as failed and dropped; when the queue is full (the webhook is down
for long), the newest alert is dropped and counted the same way, so a dead webhook costs memory for
``QUEUE_SIZE`` alerts at most.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass

from unicron.kernel import log as ulog

log = ulog.get(__name__)

QUEUE_SIZE = 1000


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx answer to the POST is an HTTPError (a failed attempt), not followed: urllib follows a
    301/302/303 with a GET without the body, whose 2xx counted as delivered though no alert arrived."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


#: the webhook's opener: urllib's default handlers (proxies from the environment included) but redirects
_OPENER = urllib.request.build_opener(_NoRedirect)


@dataclass(frozen=True)
class AlertMessage:
    alert_id: str
    message: str
    task: str | None
    node: str | None
    ts: float
    cluster: str


class WebhookNotifier:
    def __init__(self, url: str, timeout_s: float = 2.0, retries: int = 3, backoff_s: float = 0.5,
                 on_failure: Callable[[], None] | None = None) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.on_failure = on_failure
        self.sent = 0
        self._queue: queue.Queue[AlertMessage | None] = queue.Queue(maxsize=QUEUE_SIZE)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="alert-webhook", daemon=True)

    def start(self) -> WebhookNotifier:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Full):  # a full queue wakes the thread anyway
            self._queue.put_nowait(None)
        self._thread.join(timeout=self.timeout_s + 1.0)

    def send(self, alert: AlertMessage) -> None:
        """Queue ``alert``; never blocks."""
        try:
            self._queue.put_nowait(alert)
        except queue.Full:
            log.error("alert webhook queue full; alert dropped", alert=alert.alert_id, message=alert.message)
            self._failed()

    def _failed(self) -> None:
        if self.on_failure is not None:
            self.on_failure()

    def _run(self) -> None:
        while not self._stop.is_set():
            alert = self._queue.get()
            if alert is None:
                return
            self._deliver(alert)

    def _deliver(self, alert: AlertMessage) -> None:
        body = json.dumps(asdict(alert)).encode()
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.url, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with _OPENER.open(request, timeout=self.timeout_s) as reply:
                    if 200 <= reply.status < 300:
                        self.sent += 1
                        return
                    error = f"HTTP {reply.status}"
            except urllib.error.HTTPError as exc:  # a non-2xx answer
                error = f"HTTP {exc.code}"
                if 300 <= exc.code < 400:
                    error += f" (a redirect to {exc.headers.get('Location')!r}: give --alert-webhook that URL)"
            except (urllib.error.URLError, OSError) as exc:
                error = str(exc)
            log.warning("alert webhook failed", alert=alert.alert_id, attempt=attempt + 1, error=error)
            if attempt < self.retries and self._stop.wait(delay):
                break
            delay *= 2
        log.error("alert not delivered to the webhook", alert=alert.alert_id, message=alert.message)
        self._failed()
