"""The vLLM range the plugin's package declares (its `vllm` extra) is
exactly the releases it accepts at start-up (vllm_hi_plugin.SUPPORTED_VLLM); PyPI's
`vllm-hi`, whose module has our name, is found when installed."""

import os
import re
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_hi_plugin import SUPPORTED_VLLM  # noqa: E402


def accepts(spec: str, version: str) -> bool:
    """A PEP 440 specifier of >=, <, != and !=X.Y.* clauses, for X.Y.Z."""
    def key(v):
        return tuple(int(x) for x in v.split("."))
    for clause in spec.split(","):
        op, v = re.match(r"(>=|<|!=)(.+)", clause.strip()).groups()
        if op == ">=" and key(version) < key(v):
            return False
        if op == "<" and key(version) >= key(v):
            return False
        if op == "!=" and v.endswith(".*") and version.startswith(v[:-1]):
            return False
    return True


class SupportedRangeTest(unittest.TestCase):
    def test_the_extra_names_the_supported_releases(self):
        path = os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")
        with open(path) as f:
            spec = re.search(r'^vllm = \["vllm([^"]+)"\]', f.read(), re.M).group(1)
        for minor in range(20, 40):
            for patch in (0, 1, 5):
                v = f"0.{minor}.{patch}"
                self.assertEqual(accepts(spec, v), v.startswith(SUPPORTED_VLLM), v)


class SeedPackageTest(unittest.TestCase):
    def test_the_other_vllm_hi_package_is_found(self):
        from importlib import metadata
        from unittest import mock

        from vllm_hi_plugin import plugin

        def version(name):
            if name == "vllm-hi":
                return "0.3.1"
            raise metadata.PackageNotFoundError(name)

        with mock.patch.object(metadata, "version", version):
            self.assertEqual(plugin.seed_package(), "0.3.1")
        with mock.patch.object(metadata, "version", mock.Mock(side_effect=metadata.PackageNotFoundError("vllm-hi"))):
            self.assertIsNone(plugin.seed_package())


if __name__ == "__main__":
    unittest.main()
