"""titanite's test device (tests only): `pip install --no-build-isolation tests/device`.

It declares no entry points at all, so PyTorch's device autoload never loads it: tests import
`titanite_testdev` explicitly, and another PrivateUse1 backend stays free to load.
"""

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    name="titanite-testdev",
    version="0.1.0",
    packages=["titanite_testdev"],
    ext_modules=[CppExtension("titanite_testdev._C", ["titanite_testdev/csrc/tdev.cpp"],
                              extra_compile_args=["-O1"])],
    cmdclass={"build_ext": BuildExtension},
)
