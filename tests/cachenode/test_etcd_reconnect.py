"""A process reaches etcd as soon as etcd answers, however long it was out of reach: real etcd,
started late on the address a client has been calling."""

from __future__ import annotations

import asyncio
import time

from kvring.common.errors import MembershipError
from kvring.local.cluster import LocalEtcd
from kvring.membership.etcd import Etcd
from kvring.membership.loop import etcd_loop
from kvring.membership.settings import EtcdSettings

OUTAGE_S = 30.0


def test_a_client_reaches_etcd_at_once_when_it_comes_after_a_long_outage():
    """gRPC shares subchannels between a process's channels, and with them their reconnect
    backoff, which grows while the address refuses.  Every kvring process keeps calling etcd
    through an outage (a connector that has not reached its cluster, the registrar's refresh,
    the membership's resync), each call on a fresh connection; without a subchannel of their own,
    the connections made once etcd was there waited out that backoff (here 1.2-12 s after it
    answered, and 5-25 s for a connector reaching its cluster after 40-55 s).  etcd is out of
    reach for 30 s while a caller tries every second; once it answers, a call succeeds within
    1 s."""
    server = LocalEtcd()  # its port chosen, nothing listening yet
    client = Etcd(EtcdSettings.parse(server.endpoint, cluster="reconnect", timeout=2.0))

    def answered() -> bool:
        call = client.call(lambda c: c.get(b"/kvring/reconnect/contract"))
        try:
            asyncio.run_coroutine_threadsafe(call, etcd_loop()).result(10)
            return True
        except MembershipError:
            return False

    try:
        end = time.monotonic() + OUTAGE_S
        while time.monotonic() < end:
            assert not answered()
            time.sleep(1.0)
        server.start()  # answers its health check before this returns
        back = time.monotonic()
        while not answered():
            assert time.monotonic() - back < 1.0, "etcd answers, but the client has not reached it within 1 s"
            time.sleep(0.1)
    finally:
        asyncio.run_coroutine_threadsafe(client.close(), etcd_loop()).result(10)
        server.close()
