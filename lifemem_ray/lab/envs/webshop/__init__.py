"""WebShop over a generated catalogue (:mod:`.env`): the catalogue and its search engine
(:mod:`.catalogue`, product types in :mod:`.product_types`), the pages (:mod:`.pages`) and
WebShop's reward (:mod:`.reward`)."""

from lifemem_ray.lab.envs.webshop.env import WebShopEnv

__all__ = ["WebShopEnv"]
