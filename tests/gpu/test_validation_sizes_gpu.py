"""The cases of tests/cpu/test_validation_sizes.py on the GPU backend: the same inputs accepted, the
same rejected with the same messages. Collective (`make test-gpu`); R is the run's rank count."""
import pytest

from tests.conftest import on_all_ranks
from tests.helpers.validation import size_and_dtype_cases

pytestmark = pytest.mark.gpu


def test_sizes_and_index_dtypes_gpu(dist_env):
    on_all_ranks(dist_env, lambda: size_and_dtype_cases(dist_env.group, dist_env.rank, dist_env.device))
