"""The address the coordinator advertises in the leader key (issue #16: never a wildcard)."""

from __future__ import annotations

import pytest

from coordinator.settings import CoordinatorSettings, advertise_host
from unicron.kernel.errors import ConfigError


def test_a_listen_address_is_advertised_as_is() -> None:
    assert advertise_host(CoordinatorSettings(listen_host="10.1.2.3", etcd="10.9.9.9:2379")) == "10.1.2.3"


def test_a_wildcard_listen_address_advertises_the_route_to_etcd() -> None:
    # loopback's route leaves from loopback; the namespace test covers a real interface (test_netns)
    assert advertise_host(CoordinatorSettings(listen_host="0.0.0.0", etcd="127.0.0.1:2379,10.9.9.9:2379")) \
        == "127.0.0.1"


def test_the_setting_wins_and_may_not_be_a_wildcard() -> None:
    assert advertise_host(CoordinatorSettings(listen_host="0.0.0.0", advertise_host="coord.example")) \
        == "coord.example"
    with pytest.raises(ConfigError, match="UNICRON_COORDINATOR_ADVERTISE_HOST"):
        CoordinatorSettings(advertise_host="0.0.0.0").validate()
