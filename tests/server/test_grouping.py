"""The server tests run in one pytest-xdist worker (tests/conftest.py groups them): the live servers and the Ray
deployment start once. With pytest 9.2 and pytest-xdist 3.8 the group was silently lost, so both workers started
Ray in one namespace and the second deployment replaced the first's replicas mid-test (pyproject.toml pins pytest)."""


def test_the_server_tests_are_one_group_under_loadgroup(request):
    if not request.config.getoption("loadgroup", default=False):  # not an xdist worker under --dist loadgroup
        return
    assert request.node.nodeid.endswith("@server"), request.node.nodeid
