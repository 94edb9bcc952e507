"""Models shared by several test modules (each written once, in ``numpyro_fedvi.models``)."""

from numpyro_fedvi.models.eight_schools import SIGMA as SCHOOLS_SIGMA  # noqa: F401
from numpyro_fedvi.models.eight_schools import Y as SCHOOLS_Y  # noqa: F401
from numpyro_fedvi.models.eight_schools import centred as eight_schools  # noqa: F401
from numpyro_fedvi.models.eight_schools import noncentred as eight_schools_noncentred  # noqa: F401
