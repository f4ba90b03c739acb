"""Package discovery: ``nsa_backend``, the console script's launcher ``nsa_backend_cli`` (kept apart so
``nsa-backend --help`` imports no torch), and ``integrations/`` installed as ``nsa_backend_integrations``."""

from setuptools import find_packages, setup

core = find_packages(include=["nsa_backend", "nsa_backend.*", "nsa_backend_cli", "nsa_backend_cli.*"])
integrations = [
    "nsa_backend_integrations" + name[len("integrations"):]
    for name in find_packages(include=["integrations", "integrations.*"])
]
setup(packages=core + integrations, package_dir={"nsa_backend_integrations": "integrations"})
