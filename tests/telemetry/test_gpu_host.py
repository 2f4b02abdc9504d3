"""GPU probe (real NVML where there is one; readable unavailable record where not) and host."""

import time
from types import SimpleNamespace

from vconsole.engine.publish.host import HostProbe
from vconsole.telemetry.gpu import GpuProbe, memory_share


def test_gpu_probe_on_this_machine_is_unavailable_with_a_reason():
    probe = GpuProbe()
    for _ in range(2):  # the failure is remembered, the second read is the same record
        rec = probe.read()
        if rec["available"]:  # a machine with a driver: the real readings
            d = rec["devices"][0]
            assert d["mem_total"] > 0 and isinstance(d["name"], str)
        else:
            assert rec["devices"] == [] and isinstance(rec["error"], str) and rec["error"]
    probe.close()


class FakeNvmlError(Exception):
    def __init__(self, value):
        super().__init__(f"code {value}")
        self.value = value


class FakeNvml:
    """The subset of pynvml the probe uses: two devices, device 1 lacks power readings."""

    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def __init__(self, init_error=None):
        self.init_error, self.shutdowns = init_error, 0

    def nvmlInit(self):
        if self.init_error is not None:
            raise FakeNvmlError(self.init_error)

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"Fake GPU" if h == 0 else "Fake GPU 2"

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=40 + h, memory=10)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=(h + 1) * 10 << 30, total=80 << 30, free=0)

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 55

    def nvmlDeviceGetPowerUsage(self, h):
        if h == 1:
            raise FakeNvmlError(self.NVML_ERROR_NOT_SUPPORTED)
        return 250_500

    def nvmlDeviceGetClockInfo(self, h, clock):
        assert clock == self.NVML_CLOCK_SM
        return 1980


def test_gpu_probe_reads_every_device_and_nulls_an_unsupported_metric():
    nv = FakeNvml()
    probe = GpuProbe(nvml=nv)
    rec = probe.read()
    assert rec["available"] and rec["error"] is None
    d0, d1 = rec["devices"]
    assert d0 == {"index": 0, "name": "Fake GPU", "util": 40.0, "mem_used": 10 << 30,
                  "mem_total": 80 << 30, "temp_c": 55, "power_w": 250.5, "sm_clock_mhz": 1980}
    assert d1["name"] == "Fake GPU 2" and d1["power_w"] is None and d1["temp_c"] == 55
    assert memory_share(rec) == 0.25
    probe.close()
    assert nv.shutdowns == 1


def test_gpu_probe_init_failure_is_a_readable_record():
    rec = GpuProbe(nvml=FakeNvml(init_error=9)).read()
    assert rec == {"available": False, "devices": [],
                   "error": "NVIDIA driver not loaded [code 9]"}
    assert memory_share(rec) is None


def test_host_probe_figures_are_plausible():
    probe = HostProbe()
    end = time.process_time() + 0.2
    while time.process_time() < end:  # burn some CPU so the primed counter has something
        pass
    rec = probe.read()
    assert rec["proc_rss_bytes"] > 1 << 20
    assert rec["proc_num_threads"] >= 1
    assert rec["proc_cpu_percent"] > 0
    assert 0 <= rec["sys_cpu_percent"] <= 100
    assert 0 < rec["sys_mem_used"] < rec["sys_mem_total"]
    assert HostProbe(pid=2**22 + 12345).read()["proc_rss_bytes"] is None  # no such process
