"""The local launcher: the whole mesh as processes on one machine (`make serve`).

It sits above the services (it reads their configs to start them) and nothing imports it
but the tests and benches; `services/` stays the ground floor every service imports.
"""
