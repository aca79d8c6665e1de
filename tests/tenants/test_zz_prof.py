import cProfile, pstats, pytest
from tests.tenants.test_apply import config
from tenants.config import apply_config
pytestmark = pytest.mark.django_db

def test_prof():
    apply_config(config())
    pr = cProfile.Profile(); pr.enable()
    apply_config(config())
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
