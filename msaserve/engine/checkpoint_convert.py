"""The engine's entry to checkpoint conversion (the platform reaches models only through the
engine): `msaserve convert` calls these."""

from msaserve.models.convert import REPORT_FILE, convert_checkpoint
from msaserve.models.index_calibration import CalibrationSettings, LayerReport

__all__ = ["REPORT_FILE", "CalibrationSettings", "LayerReport", "convert_checkpoint"]
