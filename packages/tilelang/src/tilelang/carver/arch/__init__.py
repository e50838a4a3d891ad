"""`tilelang.carver.arch`: `driver.get_num_sms()` and friends."""

from . import driver

__all__ = ["driver"]
