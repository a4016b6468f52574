"""Put this folder first on PYTHONPATH to run as an install without nvidia-cutlass-dsl would (the ``triton`` extra
alone): importing ``cutlass`` fails, whatever is installed. CI runs the self-check and the tests that name the
backends so."""

import sys


class _HideCutlass:
    def find_spec(self, name, path=None, target=None):
        if name == "cutlass" or name.startswith("cutlass."):
            raise ModuleNotFoundError("No module named 'cutlass'", name="cutlass")
        return None


sys.meta_path.insert(0, _HideCutlass())
