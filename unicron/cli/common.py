"""What the cluster commands share: etcd connection flags and table/JSON output."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from unicron.kernel import tls
from unicron.kernel.config import out_of_bounds
from unicron.kernel.errors import StoreUnavailable
from unicron.kernel.etcd import Store, connect_error, unreachable_remedy
from unicron.kernel.keyspace import DEFAULT_PREFIX, Keyspace

N = TypeVar("N", int, float)

#: the most of an error message the CLI prints (a server's message may carry a whole repr)
MAX_ERROR_CHARS = 500


def one_line(message: str) -> str:
    """``message`` as one line of bounded length, for "unicron CMD: <message>" on stderr."""
    text = " ".join(message.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def at_least(cast: Callable[[str], N], minimum: N, *, above: bool = False, most: N | None = None) -> Callable[[str], N]:
    """An argparse ``type``: a finite number ``>= minimum`` (``> minimum`` with ``above``), and
    ``<= most`` if given. argparse turns the refusal into one line naming the flag, where a NaN
    timeout used to wait forever."""

    def parse(text: str) -> N:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number") from None
        why = (out_of_bounds(value, above=minimum, most=most) if above
               else out_of_bounds(value, least=minimum, most=most))
        if why is not None:
            raise argparse.ArgumentTypeError(f"{text!r} {why}")
        return value

    return parse


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", default=os.environ.get("UNICRON_ETCD", "127.0.0.1:2379"),
                   help="etcd endpoints host:port[,...] (env: UNICRON_ETCD; default 127.0.0.1:2379)")
    p.add_argument("--prefix", default=os.environ.get("UNICRON_PREFIX", DEFAULT_PREFIX),
                   help=f"etcd key prefix (env: UNICRON_PREFIX; default {DEFAULT_PREFIX})")
    p.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")
    p.add_argument("--tls-dir", default=os.environ.get("UNICRON_TLS_DIR", ""), metavar="DIR",
                   help="mutual TLS to etcd and the coordinator with DIR/ca.crt and DIR/NAME.crt/.key "
                        "(env: UNICRON_TLS_DIR; default: plaintext)")
    p.add_argument("--tls-name", default=os.environ.get("UNICRON_TLS_NAME", "operator"), metavar="NAME",
                   help="the certificate to present, DIR/NAME.crt (env: UNICRON_TLS_NAME; default operator)")


def tls_config(args: argparse.Namespace) -> tls.TLSConfig | None:
    """The CLI's own certificate (``--tls-dir`` / ``--tls-name``), None for plaintext."""
    return tls.load(str(getattr(args, "tls_dir", "") or ""), str(getattr(args, "tls_name", "operator")))


def open_store(args: argparse.Namespace) -> tuple[Store, Keyspace]:
    config = tls_config(args)
    store = Store(args.etcd, timeout_s=3.0, tls_config=config)
    try:
        store.revision()
    except StoreUnavailable as exc:
        store.close()
        why = connect_error(exc)
        raise StoreUnavailable(f"cannot reach etcd at {args.etcd}{f' ({why})' if why else ''}: "
                               f"{unreachable_remedy(why, config is not None)}") from exc
    return store, Keyspace(args.prefix)


def read_json_prefix(store: Store, prefix: str) -> list[tuple[str, dict[str, Any]]]:
    """(key, parsed record) under ``prefix``; a value that is not a JSON object comes back as {"error": ...}
    (a caller's ``.get`` on a list or a number was a traceback)."""
    kvs, _ = store.get_prefix(prefix)
    out: list[tuple[str, dict[str, Any]]] = []
    for kv in kvs:
        try:
            value = json.loads(kv.value)
        except ValueError:
            out.append((kv.key, {"error": f"unparsable value {kv.value[:60]!r}"}))
            continue
        out.append((kv.key, value if isinstance(value, dict) else {"error": "not a JSON object"}))
    return out


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    if not rows:
        print("(none)")
        return
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def emit(args: argparse.Namespace, rows: list[dict[str, Any]], columns: Sequence[str]) -> int:
    if args.json:
        json.dump(rows, sys.stdout, indent=2, default=str)
        print()
    else:
        print_table(rows, columns)
    return 0
