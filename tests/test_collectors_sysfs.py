"""Net and InfiniBand/RoCE collectors against sysfs fixture trees, golden expositions, and the real
/sys/class/net of this machine. Fixture trees: tests/fixtures/make_sysfs.py; goldens regenerate with
SYNCWATCH_UPDATE_GOLDEN=1."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import pytest

from collector_helpers import FIXTURES, GOLDEN, check_golden, promtool_check, registry_of, render
from conftest import run_unprivileged
from syncwatch.collectors import NoData
from syncwatch.collectors.infiniband import InfinibandCollector, parse_rate
from syncwatch.collectors.net import NetCollector
from syncwatch.sim.sysfs_tree import PMA_WIDTHS, ib_port, nic
from syncwatch.collectors.sysfs import Absent, Unreadable, read_int, read_text

SYSFS = FIXTURES / "sysfs"


def collect(root) -> tuple[list, list[str]]:
    errors: list[str] = []
    families = []
    for c in (NetCollector(str(root)), InfinibandCollector(str(root))):
        families += [f for f in c.update(errors) if f.samples]
    return families, errors


@pytest.fixture
def tree():
    """A private copy of a fixture tree, traversable by an unprivileged user."""
    made = []

    def copy(scenario: str):
        d = tempfile.mkdtemp(prefix="sw-sysfs-")
        os.chmod(d, 0o755)
        dst = os.path.join(d, "sys")
        shutil.copytree(SYSFS / scenario, dst, symlinks=True)
        made.append(d)
        return dst
    yield copy
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


# scenario -> substrings that must each appear in exactly the reported errors (none = clean)
COMMITTED = {
    "healthy": [],
    "congested": [],
    "link_flapping": [],
    "missing_counters": [],
    "garbage": ["eno1/statistics/rx_bytes: not an integer", "eno1/carrier_changes: not an integer",
                "ens1f0np0/speed: not an integer", "counters/port_xmit_wait: not an integer",
                "mlx5_0/ports/1/rate: unparsable rate", "hw_counters/np_cnp_sent: not an integer"],
}


def assert_errors(errors: list[str], expected: list[str]) -> None:
    assert len(errors) == len(expected), errors
    for needle in expected:
        assert any(needle in e for e in errors), (needle, errors)


@pytest.mark.parametrize("scenario", sorted(COMMITTED))
def test_fixture_scenario_matches_golden(scenario):
    families, errors = collect(SYSFS / scenario)
    assert_errors(errors, COMMITTED[scenario])
    check_golden(f"sysfs_{scenario}", render(families))


def test_fixture_counters_fit_the_kernels_field_widths():
    """The kernel prints each PerfMgt counter from a fixed-width field (drivers/infiniband/core/
    sysfs.c), which stops at its maximum: a value wider than that is one no port shows. The
    congested tree had port_xmit_wait 9812334551 (32 bits: at most 4294967295) and link_flapping
    local_link_integrity_errors 17 (4 bits: at most 15), and the tests asserted them."""
    checked = 0
    for path in sorted(SYSFS.glob("*/class/infiniband/*/ports/*/counters/*")):
        text = path.read_text().strip()
        if text.isdigit():
            assert int(text) < 2 ** PMA_WIDTHS[path.name], (str(path.relative_to(SYSFS)), text)
            checked += 1
    assert checked > 100


def test_fixture_mlx5_ports_have_hw_counters_on_both_link_layers():
    """mlx5 registers its hw_counters for every port of an HCA, InfiniBand and RoCE alike
    (drivers/infiniband/hw/mlx5/counters.c: mlx5_ib_counters_init sets alloc_hw_port_stats
    whenever the HCA has queue counters, max_qp_cnt, whatever the link layer; pf_profile, the
    profile of both, runs it). The InfiniBand HCA of the fixture trees had none: a port no mlx5
    HCA shows. Only the missing_counters scenario leaves them out, on purpose."""
    ports = [p for p in sorted(SYSFS.glob("*/class/infiniband/mlx5_*/ports/*"))
             if p.parts[len(SYSFS.parts)] != "missing_counters"]
    layers = {(p / "link_layer").read_text().strip() for p in ports}
    assert layers == {"InfiniBand", "Ethernet"}
    for port in ports:
        for name in ("out_of_sequence", "packet_seq_err", "local_ack_timeout_err"):
            assert (port / "hw_counters" / name).is_file(), (str(port.relative_to(SYSFS)), name)


@pytest.mark.parametrize("counter,value", [("local_link_integrity_errors", 16), ("link_downed", 256),
                                           ("symbol_error", 65_536), ("port_xmit_wait", 2 ** 32)])
def test_writer_refuses_counters_wider_than_the_kernels(tmp_path, counter, value):
    with pytest.raises(ValueError, match=counter):
        ib_port(tmp_path, "mlx5_0", 1, link_layer="InfiniBand", counters={counter: value})
    ib_port(tmp_path, "mlx5_0", 1, link_layer="InfiniBand", counters={counter: value - 1})  # its maximum


@pytest.mark.parametrize("counter", ["out_of_sequence", "packet_seq_err", "local_ack_timeout_err"])
def test_writer_refuses_queue_counters_wider_than_32_bits(tmp_path, counter):
    """mlx5 reads its queue counters as 32-bit values (counters.c, mlx5_ib_query_q_counters:
    ``be32_to_cpu``); only the congestion counters are 64-bit (``_high``/``_low``). The writer
    took any value, and the docs called every hw_counter 64-bit."""
    with pytest.raises(ValueError, match=counter):
        ib_port(tmp_path, "mlx5_1", 1, link_layer="Ethernet", hw={counter: 2 ** 32})
    ib_port(tmp_path, "mlx5_1", 1, link_layer="Ethernet", hw={counter: 2 ** 32 - 1, "np_cnp_sent": 2 ** 40})


def test_healthy_values_and_units():
    reg = registry_of(collect(SYSFS / "healthy")[0])
    v = reg.get_sample_value
    assert v("syncwatch_nic_speed_bytes", {"device": "ens1f0np0"}) == 200_000 * 1e6 / 8
    assert v("syncwatch_nic_speed_bytes", {"device": "eno1"}) == 125e6
    assert v("syncwatch_nic_up", {"device": "eno1"}) == 1
    assert v("syncwatch_nic_receive_bytes_total", {"device": "eno1"}) == 81_223_004
    assert v("syncwatch_nic_receive_bytes_total", {"device": "lo"}) is None  # excluded by default
    ib = {"device": "mlx5_0", "port": "1"}
    assert v("syncwatch_ib_port_data_bytes_total", {**ib, "direction": "transmit"}) == 2_503_104_811_520 * 4
    assert v("syncwatch_ib_port_data_bytes_total", {**ib, "direction": "receive"}) == 2_498_775_012_864 * 4
    assert v("syncwatch_ib_port_rate_bytes", ib) == 25e9
    assert v("syncwatch_ib_port_up", ib) == 1
    # mlx5 has hw_counters on an InfiniBand port too: its queue counters (transport, not RoCE)
    assert v("syncwatch_roce_out_of_sequence_total", ib) == 0
    assert v("syncwatch_roce_retransmits_total", {**ib, "reason": "nak_sequence"}) == 0
    assert v("syncwatch_roce_cnp_sent_total", ib) is None  # no congestion counters on this HCA
    assert v("syncwatch_roce_cnp_sent_total", {"device": "mlx5_1", "port": "1"}) == 0


def test_congested_shows_congestion_signals():
    reg = registry_of(collect(SYSFS / "congested")[0])
    v = reg.get_sample_value
    roce = {"device": "mlx5_1", "port": "1"}
    assert v("syncwatch_roce_cnp_sent_total", roce) == 8_812_004
    assert v("syncwatch_roce_cnp_handled_total", roce) == 7_990_312
    assert v("syncwatch_roce_ecn_marked_total", roce) == 12_030_455
    assert v("syncwatch_roce_out_of_sequence_total", roce) == 40_213
    assert v("syncwatch_roce_retransmits_total", {**roce, "reason": "ack_timeout"}) == 1_022
    assert v("syncwatch_roce_retransmits_total", {**roce, "reason": "nak_sequence"}) == 3_981
    assert v("syncwatch_ib_port_xmit_wait_total", {"device": "mlx5_0", "port": "1"}) == 3_812_334_551
    assert v("syncwatch_ib_buffer_overrun_errors_total", {"device": "mlx5_0", "port": "1"}) == 3
    assert v("syncwatch_nic_drops_total", {"device": "ens1f0np0", "direction": "receive"}) == 18_402


def test_link_flapping():
    reg = registry_of(collect(SYSFS / "link_flapping")[0])
    v = reg.get_sample_value
    assert v("syncwatch_nic_carrier_changes_total", {"device": "ens1f0np0"}) == 47
    assert v("syncwatch_nic_up", {"device": "ens1f0np0"}) == 0
    assert v("syncwatch_nic_speed_bytes", {"device": "ens1f0np0"}) is None  # speed -1: unknown
    assert v("syncwatch_nic_errors_total", {"device": "ens1f0np0", "direction": "receive"}) == 1_204
    ib = {"device": "mlx5_0", "port": "1"}
    assert v("syncwatch_ib_port_up", ib) == 0
    assert v("syncwatch_ib_link_downed_total", ib) == 23
    assert v("syncwatch_ib_symbol_errors_total", ib) == 65_535
    assert v("syncwatch_ib_link_integrity_errors_total", ib) == 15  # saturated: a 4-bit field
    assert v("syncwatch_ib_port_rcv_errors_total", ib) == 4_410
    # DOWN: its rate file reads the kernel's SDR default, "10 Gb/sec (4X SDR)", not a link's rate
    assert v("syncwatch_ib_port_rate_bytes", ib) is None
    assert v("syncwatch_ib_port_rate_bytes", {"device": "mlx5_1", "port": "1"}) == 25e9


def test_ib_port_states_active_and_active_defer_are_up(tmp_path):
    """The kernel prints ``<n>: <name>`` for the IBTA port states 1-5; ACTIVE_DEFER (5) is an
    active port (it read as down: not ending in "ACTIVE")."""
    states = ["1: DOWN", "2: INIT", "3: ARMED", "4: ACTIVE", "5: ACTIVE_DEFER"]
    for port, state in enumerate(states, 1):
        ib_port(tmp_path, "mlx5_0", port, link_layer="InfiniBand", state=state)
    errors: list[str] = []
    v = registry_of(InfinibandCollector(str(tmp_path)).update(errors)).get_sample_value
    assert errors == []
    up = [v("syncwatch_ib_port_up", {"device": "mlx5_0", "port": str(p)}) for p in range(1, 6)]
    assert up == [0, 0, 0, 1, 1]
    assert v("syncwatch_ib_port_rate_bytes", {"device": "mlx5_0", "port": "5"}) == 25e9


def test_missing_counters_drop_only_their_series():
    reg = registry_of(collect(SYSFS / "missing_counters")[0])
    v = reg.get_sample_value
    assert v("syncwatch_nic_carrier_changes_total", {"device": "eno1"}) is None
    assert v("syncwatch_nic_drops_total", {"device": "eno1", "direction": "receive"}) is None
    assert v("syncwatch_nic_receive_bytes_total", {"device": "eno1"}) is not None
    ib = {"device": "mlx5_0", "port": "1"}  # N/A (no PMA): no counters, but state and rate
    assert v("syncwatch_ib_port_xmit_wait_total", ib) is None
    assert v("syncwatch_ib_port_up", ib) == 1
    text = render(collect(SYSFS / "missing_counters")[0])
    assert "eth9" not in text and "mlx5_2" not in text  # vanished / port-less devices


def test_fifo_in_place_of_counters_never_blocks(tree):
    root = tree("healthy")
    fifos = [os.path.join(root, "class/net/eno1/statistics/rx_bytes"),
             os.path.join(root, "class/infiniband/mlx5_1/ports/1/hw_counters/np_cnp_sent")]
    for path in fifos:
        os.unlink(path)
        os.mkfifo(path)
    result = {}
    t = threading.Thread(target=lambda: result.update(out=collect(root)), daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "a FIFO blocked the collector"
    families, errors = result["out"]
    assert_errors(errors, ["eno1/statistics/rx_bytes: not a regular file", "np_cnp_sent: not a regular file"])
    check_golden("sysfs_fifo", render(families))


def _collect_unprivileged(root: str) -> tuple[str, list[str]]:
    """Run the collectors in a child without root's rights (root ignores file modes)."""
    def work():
        families, errors = collect(root)
        return {"text": render(families), "errors": errors}
    out = run_unprivileged(work)
    return out["text"], out["errors"]


def test_permission_denied_is_reported_and_drops_only_that_series(tree):
    root = tree("healthy")
    denied = [os.path.join(root, "class/net/ens1f0np0/statistics/tx_bytes"),
              os.path.join(root, "class/infiniband/mlx5_0/ports/1/counters/symbol_error")]
    for path in denied:
        os.chmod(path, 0)
    if os.geteuid() == 0:
        text, errors = _collect_unprivileged(root)
    else:
        families, errors = collect(root)
        text = render(families)
    assert_errors(errors, ["ens1f0np0/statistics/tx_bytes: Permission denied",
                           "counters/symbol_error: Permission denied"])
    check_golden("sysfs_permission_denied", text)


def test_names_that_are_not_utf8_keep_their_series_and_the_scrape(tree):
    """Linux lets an interface name hold any byte but '/', ':' and white space. Such a name came
    through os.listdir as a lone surrogate that the exposition cannot encode: the render raised,
    and the daemon's whole /metrics failed with it."""
    root = os.fsencode(tree("healthy"))
    os.rename(os.path.join(root, b"class/net/eno1"), os.path.join(root, b"class/net/eth\xff\x01"))
    os.rename(os.path.join(root, b"class/infiniband/mlx5_0"),
              os.path.join(root, b"class/infiniband/mlx\xe9"))
    families, errors = collect(os.fsdecode(root))
    assert errors == []
    text = render(families)  # raised UnicodeEncodeError
    promtool_check(text)
    reg = registry_of(families)
    v = reg.get_sample_value
    assert v("syncwatch_nic_receive_bytes_total", {"device": "eth\\xff\x01"}) == 81_223_004
    assert v("syncwatch_nic_speed_bytes", {"device": "eth\\xff\x01"}) == 125e6
    ib = {"device": "mlx\\xe9", "port": "1"}
    assert v("syncwatch_ib_port_data_bytes_total", {**ib, "direction": "transmit"}) == 2_503_104_811_520 * 4
    assert v("syncwatch_ib_port_up", ib) == 1


def test_virtual_interfaces_are_skipped_unless_asked_for(tmp_path):
    """A host's sysfs as the kernel lays it out: ``class/net/<dev>`` links to the device's
    directory, under its PCI function for a NIC and under ``devices/virtual`` for loopback, a
    CNI bridge and a Calico veth. By default only the NIC is read; with ``virtual`` all are."""
    sys_root = tmp_path / "sys"
    (sys_root / "class" / "net").mkdir(parents=True)
    homes = {"eno1": "devices/pci0000:00/0000:00:1f.6/net/eno1", "lo": "devices/virtual/net/lo",
             "cni0": "devices/virtual/net/cni0", "cali3f2a": "devices/virtual/net/cali3f2a"}
    for dev, home in homes.items():
        made = nic(tmp_path / "stage", dev, speed="25000")
        (sys_root / home).parent.mkdir(parents=True, exist_ok=True)
        made.rename(sys_root / home)
        (sys_root / "class" / "net" / dev).symlink_to(os.path.join("..", "..", home))

    def devices(collector) -> set[str]:
        errors: list[str] = []
        reg = registry_of([f for f in collector.update(errors) if f.samples])
        assert errors == []
        return {d for d in homes if reg.get_sample_value("syncwatch_nic_up", {"device": d}) == 1}

    assert devices(NetCollector(str(sys_root), exclude="")) == {"eno1"}
    assert devices(NetCollector(str(sys_root), exclude="", virtual=True)) == set(homes)
    assert devices(NetCollector(str(sys_root), virtual=True)) == {"eno1", "cni0", "cali3f2a"}


def test_fixture_interfaces_link_to_their_devices_as_in_real_sysfs():
    """Every ``class/net`` entry of real sysfs is a symlink to its device's directory: under the
    PCI function for a NIC, under ``devices/virtual/net`` for loopback (this machine:
    ``lo -> ../../devices/virtual/net/lo``, ``eth0 -> ../../devices/pci0000:00/.../net/eth0``).
    The fixture trees held plain directories, so their ``lo`` read as a physical NIC."""
    for entry in sorted(SYSFS.glob("*/class/net/*")):
        assert entry.is_symlink(), str(entry.relative_to(SYSFS))
        assert os.readlink(entry).startswith(os.path.join("..", "..", "devices", "")), os.readlink(entry)
    errors: list[str] = []
    reg = registry_of([f for f in NetCollector(str(SYSFS / "healthy"), exclude="").update(errors) if f.samples])
    assert errors == []
    assert reg.get_sample_value("syncwatch_nic_up", {"device": "eno1"}) == 1
    assert reg.get_sample_value("syncwatch_nic_receive_bytes_total", {"device": "lo"}) is None  # virtual


def test_absent_tree_is_quiet_no_data(tmp_path):
    for c in (NetCollector(str(tmp_path)), InfinibandCollector(str(tmp_path))):
        with pytest.raises(NoData):
            c.update([])


def test_real_sys_class_net_reads_without_error():
    if not os.path.isdir("/sys/class/net"):
        pytest.skip("no /sys/class/net on this machine")
    errors: list[str] = []
    families = NetCollector("/sys", exclude="", virtual=True).update(errors)
    assert errors == []
    reg = registry_of([f for f in families if f.samples])
    for dev in os.listdir("/sys/class/net"):
        assert reg.get_sample_value("syncwatch_nic_receive_bytes_total", {"device": dev}) is not None, dev
    promtool_check(render([f for f in families if f.samples]))


@pytest.mark.parametrize("golden", sorted(p.name for p in GOLDEN.glob("*.prom")) or ["(none)"])
def test_promtool_accepts_every_golden_file(golden):
    assert golden != "(none)", "no golden files: run with SYNCWATCH_UPDATE_GOLDEN=1"
    promtool_check((GOLDEN / golden).read_text())


# --- the reader itself ---------------------------------------------------------------------------

def test_reader_rejects_fifo_without_writer_promptly(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(Unreadable, match="not a regular file"):
        read_text(str(fifo))
    assert time.monotonic() - start < 1


def test_reader_classifies_outcomes(tmp_path):
    (tmp_path / "n").write_text("42\n")
    (tmp_path / "pma").write_text("N/A (no PMA)\n")
    (tmp_path / "bad").write_text("4 2\n")
    assert read_int(str(tmp_path / "n")) == 42
    with pytest.raises(Absent):
        read_int(str(tmp_path / "pma"))
    with pytest.raises(Absent):
        read_int(str(tmp_path / "gone"))
    with pytest.raises(Unreadable, match="not an integer"):
        read_int(str(tmp_path / "bad"))
    with pytest.raises(Unreadable, match="not a regular file"):
        read_text("/dev/zero")  # would never end if read as a file
    with pytest.raises(Unreadable, match="not a regular file"):
        read_text(str(tmp_path))


def test_reader_einval_is_absent():
    """A down link's speed answers EINVAL in real sysfs (ifb/lo here): quiet, not an error."""
    for dev in sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []:
        try:
            open(f"/sys/class/net/{dev}/speed").read()
        except OSError as e:
            if e.errno == 22:
                with pytest.raises(Absent):
                    read_int(f"/sys/class/net/{dev}/speed")
                return
    pytest.skip("no interface answering EINVAL for speed on this machine")


@pytest.mark.parametrize("text,expected", [
    ("200 Gb/sec (4X HDR)", 25e9), ("400 Gb/sec (4X NDR)", 50e9), ("2.5 Gb/sec (1X SDR)", 312.5e6),
    ("56 Gb/sec (4X FDR)", 7e9), ("100 Mb/sec", 12.5e6)])
def test_parse_rate(text, expected):
    assert parse_rate(text) == expected
