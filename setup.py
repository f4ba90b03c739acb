"""Package discovery: ``integrations/`` installs as ``nsa_backend_integrations``."""

from setuptools import find_packages, setup

core = find_packages(include=["nsa_backend", "nsa_backend.*"])
integrations = [
    "nsa_backend_integrations" + name[len("integrations"):]
    for name in find_packages(include=["integrations", "integrations.*"])
]
setup(packages=core + integrations, package_dir={"nsa_backend_integrations": "integrations"})
