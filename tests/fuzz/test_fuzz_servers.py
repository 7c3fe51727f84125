"""Fuzzed lines to the real servers: the agent's RankServer (Unix socket), the coordinator's LinkServer
(TCP), the gRPC API of a real coordinator on real etcd, and records written into that etcd under the
keys the coordinator watches. After the fuzz each still answers a valid peer."""

from __future__ import annotations

from tests.fuzz.harness import Fuzz, run_api, run_coordinator_etcd, run_link_server, run_rank_server


def test_rank_server_skips_fuzzed_lines_and_keeps_serving() -> None:
    fuzz = Fuzz(raise_on_crash=True)
    run_rank_server(fuzz, 120)
    assert fuzz.crashes == []
    assert fuzz.cases["rank_server"] >= 60


def test_link_server_refuses_or_skips_fuzzed_lines_and_keeps_serving() -> None:
    fuzz = Fuzz(raise_on_crash=True)
    run_link_server(fuzz, 120)
    assert fuzz.crashes == []
    assert fuzz.cases["link_server"] >= 60


def test_api_answers_fuzzed_specs_with_invalid_argument_or_accepts_them() -> None:
    fuzz = Fuzz(raise_on_crash=True)
    run_api(fuzz, 80)
    assert fuzz.crashes == []
    assert fuzz.cases["api_submit"] >= 40
    assert fuzz.accepted["api_submit"] > 0  # the after-fuzz submit at least


def test_a_coordinator_skips_or_takes_fuzzed_etcd_records_and_keeps_answering() -> None:
    fuzz = Fuzz(raise_on_crash=True)
    run_coordinator_etcd(fuzz, 80)
    assert fuzz.crashes == []
    assert fuzz.cases["coordinator_etcd"] >= 40
