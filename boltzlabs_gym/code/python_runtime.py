"""The Python runtime programs run under (``python`` and ``pytest``): a venv of its own, separate
from the project's interpreter, made from the system's Python under ``/usr`` (which every sandbox
shows); the code runner's envs and their warm template run under it (``CodeRunner(python="auto")``).

:data:`PACKAGES` is what it gets by default: SandboxFusion's Python runtime (its
``runtime/python/requirements.txt``), as it installs on Debian 12's Python 3.11.
:data:`CORE_PACKAGES` is the small set SandboxFusion-style programs import most, for machines (CI)
where the full set takes too long or too much disk. ``boltzlabs-gym code-runtime install
[--python-packages core|full]`` makes it (:func:`install_python`).

>>> from boltzlabs_gym.code.python_runtime import CORE_PACKAGES, PACKAGES
>>> set(CORE_PACKAGES) <= set(PACKAGES) and "pytest==7.4.4" in CORE_PACKAGES
True
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence

from .install_step import RuntimeInstallError, run_step

__all__ = ["CORE_PACKAGES", "NOT_INSTALLED", "PACKAGES", "PACKAGE_SETS", "install_python"]

log = logging.getLogger(__name__)

#: SandboxFusion's Python runtime, all 102 of its requirements at its pins (made for Python 3.10;
#: each had a Python 3.11 wheel, or is pure Python from an sdist), but for what the comments say.
PACKAGES = (
    "tensorflow==2.14.1",  # PyPI's wheel runs on the CPU (it finds no CUDA and says so)
    # 2.1.2 on PyPI is a CUDA build that pulls several GB of nvidia-* wheels. The "+cpu" local
    # version is PyTorch's CPU build, which PyPI never serves: where it is not on disk (or on
    # PIP_FIND_LINKS / PyTorch's CPU index), torch fails alone instead of downloading CUDA.
    "torch==2.13.0+cpu",
    "Flask==3.0.1",
    "toml==0.10.2",
    "PyQt5==5.15.10",  # Qt runs with QT_QPA_PLATFORM=offscreen: no screen here
    "pytest-qt==4.3.1",
    "pytest-mock==3.12.0",
    "Django==5.0.1",
    "grpcio-tools==1.60.0",
    "nameko==2.14.1",
    "WTForms==3.1.2",
    "Flask-Limiter==3.5.0",
    "scipy==1.11.4",
    "rdkit==2023.9.4",
    "coverage==7.4.0",
    "bs4==0.0.2",
    "lxml==5.1.0",
    "shapely==2.0.2",
    "xlrd==2.0.1",
    "numba==0.58.1",
    "absl-py==2.1.0",
    "opencv-python==4.9.0.80",
    "pillow==10.2.0",
    "plotly==5.18.0",
    "kaleido==0.2.1",  # its wheel carries its own Chromium: nothing is downloaded at install
    "requests==2.31.0",
    "requests-toolbelt==1.0.0",
    "openpyxl==3.1.2",
    "yolk==0.4.3",
    "XlsxWriter==3.1.9",
    "Flask-RESTful==0.3.10",
    "scikit-image==0.22.0",
    "pycryptodomex==3.20.0",
    "pycryptodome==3.20.0",
    "statsmodels==0.14.1",
    "fastdtw==0.3.4",
    "kneed==0.8.5",
    "tree-sitter==0.20.4",
    "tree-sitter-languages==1.9.1",
    "GitPython==3.1.41",
    "docker==7.0.0",  # the client; programs that use it need a Docker engine, as on SandboxFusion
    "Werkzeug==3.0.1",
    "gmpy2==2.1.5",
    "pyscf==2.4.0",
    "pyberny==0.6.3",  # imports pkg_resources: see setuptools below
    "redis==5.0.1",  # redis, pika, pymongo: clients, for programs that mock their servers
    "pika==1.3.2",
    "pytest==7.4.4",
    "pymongo==4.6.1",
    "mongomock==4.1.2",  # imports pkg_resources: see setuptools below
    "scikit-learn==1.4.0",
    "jsonlines==4.0.0",
    "faiss-cpu==1.7.4",
    "beautifulsoup4==4.12.3",
    "gql==3.5.0",
    "graphene==3.3",
    # Imports fail on Python >= 3.10, as on SandboxFusion's 3.10: the graphql-server-core it gets
    # (1.1.1) imports collections.MutableMapping, and the releases that don't need graphql-core < 3,
    # which graphql-core==3.2.3 and graphene 3 below rule out. Kept: it installs, as there.
    "Flask-GraphQL==2.0.0",
    "graphql-core==3.2.3",
    "Flask-SQLAlchemy==3.1.1",
    "Flask-Caching==2.1.0",
    "Flask-Testing==0.8.1",
    "Flask-WTF==1.2.1",
    "xgboost==2.0.3",
    "gensim==4.3.2",  # gensim-data's models and corpora come from a hub at run time: not installed
    "matplotlib==3.8.2",
    "pandasql==0.7.3",
    "psutil==5.9.8",
    "datasketch==1.6.4",
    "PyJWT==2.8.0",
    "uvloop==0.19.0",
    "antlr4-python3-runtime==4.13.1",
    "numpy==1.26.3",
    "pandas==2.2.0",
    "arch==6.3.0",
    "lightgbm==4.3.0",
    "catboost==1.2.3",
    "torchinfo==1.8.0",
    "torchsummary==1.5.1",
    "xarray==2023.6.0",
    "pmdarima==2.0.4",
    "ruptures==1.1.9",
    "cryptography==42.0.5",
    # SandboxFusion's install script also downloads NLTK's punkt and stopwords data from NLTK's
    # hub (nltk.download): not here, so programs that tokenize or need stopwords fail, naming them.
    "nltk==3.8.1",
    "pulp==2.8.0",
    "cvxpy==1.4.3",
    "python-docx==1.1.2",
    "PyPDF2==3.0.1",
    "APScheduler==3.10.4",
    "colorama==0.4.4",
    "folium==0.16.0",
    "pydantic==2.6.4",
    "xlwt==1.3.0",
    "textblob==0.18.0.post0",  # its corpora (textblob.download_corpora) are NLTK hub data: not here
    "PyMuPDF==1.24.3",
    "Faker==25.1.0",
    "pyzbar==0.1.9",  # imports only with Debian's libzbar0, which SandboxFusion's image lacks too
    "pytest-cov==5.0.0",
    "astor==0.8.1",
    "jupyter==1.0.0",
    "jupyter_client==8.6.2",
    "seaborn==0.13.2",
    "tabulate==0.9.0",
    # Not on SandboxFusion's list: setuptools 81 and newer have no pkg_resources, which pyberny and
    # mongomock import (SandboxFusion's 2024 environment had an older setuptools).
    "setuptools<81",
)

#: Left out of SandboxFusion's Python runtime, and why (none of its packages: each installs here).
NOT_INSTALLED = {
    "nltk data (punkt, stopwords)": "downloaded from NLTK's hub by nltk.download, which no package registry serves",
}

#: What SandboxFusion-style datasets import most, at the same pins: pytest for the ``pytest``
#: language, numpy, pandas, scipy, scikit-learn and matplotlib (sympy and networkx are not on
#: SandboxFusion's list).
CORE_PACKAGES = (
    "pytest==7.4.4",
    "pytest-mock==3.12.0",
    "numpy==1.26.3",
    "pandas==2.2.0",
    "scipy==1.11.4",
    "scikit-learn==1.4.0",
    "matplotlib==3.8.2",
)

#: The package sets ``boltzlabs-gym code-runtime install --python-packages`` names.
PACKAGE_SETS = {"core": CORE_PACKAGES, "full": PACKAGES}


def _base_python() -> str:
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate):
            return candidate
    found = shutil.which("python3", path="/usr/local/bin:/usr/bin")
    if found is None:
        raise RuntimeInstallError(
            "no python3 under /usr (Debian: python3 python3-venv): the runtime venv needs one the sandbox shows"
        )
    return found


#: A requirement by name alone, with or without versions (what a constraints file takes: no extras, paths or URLs).
_PINNED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\s*(?:[<>=!~][^;@\[]*)?")


def _name(requirement: str) -> str:
    for i, c in enumerate(requirement):
        if c in "<>=!~;[ ":
            return requirement[:i]
    return requirement


def install_python(runtime: str, packages: Sequence[str] = PACKAGES) -> str:
    """Make ``<runtime>/python`` (a venv of the system's Python) and install ``packages`` into it
    (pip requirement strings; default :data:`PACKAGES`); the venv's path.

    All in one pip call; should that fail, each package alone (the others' pins as constraints, so
    none moves them), logging each that fails by name and pip's last words. Raises
    :class:`~boltzlabs_gym.code.install_step.RuntimeInstallError` where the venv cannot be made,
    or pytest (which the ``pytest`` language runs) does not install.
    """
    where = os.path.join(runtime, "python")
    python = os.path.join(where, "bin", "python")
    if not os.path.exists(python):
        run_step([_base_python(), "-m", "venv", where], "python -m venv")
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    log.info("code runtime: pip install of %d packages into %s", len(packages), where)
    whole = subprocess.run([*pip, *packages], capture_output=True, text=True)
    if whole.returncode == 0:
        return where
    log.warning(
        "code runtime: one pip install of all %d packages failed (%s); installing them one by one",
        len(packages),
        _last_line(whole.stderr),
    )
    failed: dict[str, str] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="constraints-") as constraints:
        constraints.write("\n".join(p for p in packages if _PINNED.fullmatch(p)) + "\n")
        constraints.flush()
        for requirement in packages:
            one = subprocess.run([*pip, "-c", constraints.name, requirement], capture_output=True, text=True)
            if one.returncode != 0:
                failed[requirement] = _last_line(one.stderr)
                log.warning("code runtime: python package %s not installed: %s", requirement, failed[requirement])
    if failed:
        log.warning(
            "code runtime: %d of %d python packages not installed: %s", len(failed), len(packages), ", ".join(failed)
        )
    if any(_name(p).lower() == "pytest" for p in failed):
        raise RuntimeInstallError(f"pip install pytest into {where} failed: {failed}")
    return where


def _last_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["no output"])[-1]
