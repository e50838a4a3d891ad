"""`tilelang.carver`: of the public TileLang's hardware-description package, only what kernels import
to size their grids (`carver.arch.driver.get_num_sms`)."""

from . import arch

__all__ = ["arch"]
