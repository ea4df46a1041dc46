"""The templates the WebShop catalogue is generated from: product types in WebShop's five categories.

WebShop's 1.18M scraped Amazon products are not installable here; the generator
(:mod:`lifemem_ray.lab.envs.webshop.catalogue`) draws products from these types instead. Each
type carries what WebShop's product records carry: the search ``query`` the product was
scraped under (WebShop's ``query`` field, also the noun phrase of the instructions), the
Amazon-style ``product_category`` path (levels joined by ``›``, as WebShop's), a pool of
attributes (WebShop's ``Attributes``: lower-case phrases such as ``high speed``), option
pools (WebShop's ``options``: option name -> values, lower case) and a price range.

``nouns`` stand in for the spaCy noun parse WebShop's type reward takes of a title: the
type's own nouns (a generated title adds its brand and model code). Values are chosen so
that no two values of one option pool, and no two attributes of one type, match each other
under WebShop's fuzzy matching (token-set ratio > 85 after colour normalisation): a goal
option names exactly one value of a product (``tests/lab/envs/test_env_webshop.py`` checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CATEGORIES", "NEUTRAL_LINES", "PRODUCT_TYPES", "ProductType"]

_LETTER_SIZES = ("xs", "s", "m", "l", "xl", "xxl", "3xl")


@dataclass(frozen=True)
class ProductType:
    """One kind of product; the generator makes several products of each."""

    category: str  # WebShop's top-level category: beauty, electronics, fashion, food, furniture
    query: str  # the search query WebShop scraped it under; the instructions' noun phrase
    path: str  # WebShop's product_category: 'Electronics › Computers & Accessories › ...'
    phrase: str  # how titles name it
    nouns: tuple[str, ...]  # the type's nouns in a title (the type reward's title match)
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]  # (option name, value pool)
    price: tuple[float, float]
    plural: bool = False  # 'some lounge pants', not 'a lounge pants'


def _t(
    category: str,
    query: str,
    path: str,
    phrase: str,
    nouns: str,
    attributes: str,
    *,
    options: list[tuple[str, Sequence[str]]],
    price: tuple[float, float],
    plural: bool = False,
) -> ProductType:
    """A type from compact text: nouns space-separated, attributes '|'-separated."""
    return ProductType(
        category=category,
        query=query,
        path=path,
        phrase=phrase,
        nouns=tuple(nouns.split()),
        attributes=tuple(a.strip() for a in attributes.split("|")),
        options=tuple((name, tuple(values)) for name, values in options),
        price=price,
        plural=plural,
    )


_E, _B, _F, _G, _H = "electronics", "beauty", "fashion", "food", "furniture"

# fmt: off
PRODUCT_TYPES: tuple[ProductType, ...] = (
    # -- electronics
    _t(_E, "usb flash drive", "Electronics › Computers & Accessories › Data Storage › USB Flash Drives",
       "USB Flash Drive", "usb flash drive",
       "high speed | plug and play | metal casing | keychain design | password protection",
       options=[("size", ["16gb", "32gb", "64gb", "128gb", "256gb"]), ("color", ["black", "silver", "blue", "red"])],
       price=(6.0, 45.0)),
    _t(_E, "wireless earbuds", "Electronics › Headphones, Earbuds & Accessories › Earbud Headphones",
       "Wireless Earbuds", "earbuds",
       "noise cancelling | long battery life | water resistant | touch control | fast charging",
       options=[("color", ["black", "white", "navy", "pink"])], price=(15.0, 120.0), plural=True),
    _t(_E, "hdmi cable", "Electronics › Television & Video › Accessories › Cables › HDMI Cables",
       "HDMI Cable", "hdmi cable",
       "high speed | gold plated | braided nylon | 4k ultra hd | ethernet support",
       options=[("size", ["3ft", "6ft", "10ft", "15ft", "25ft"]), ("style", ["single", "twin pack", "value bundle"])],
       price=(5.0, 40.0)),
    _t(_E, "wireless charger", "Electronics › Cell Phones & Accessories › Chargers & Power Adapters › Wireless Chargers",
       "Wireless Charger", "charger",
       "fast charging | output protection | led indicator | case friendly | anti slip surface",
       options=[("color", ["black", "white", "gray"]), ("style", ["pad", "stand", "car mount"])],
       price=(12.0, 50.0)),
    _t(_E, "security camera", "Electronics › Camera & Photo › Video Surveillance › Surveillance Cameras",
       "Security Camera", "security camera",
       "motion detection | night vision | two way audio | weatherproof housing | 1080p hd",
       options=[("color", ["white", "black"]), ("style", ["single camera", "twin kit", "four camera kit"])],
       price=(25.0, 180.0)),
    _t(_E, "bluetooth speaker", "Electronics › Portable Audio & Video › Portable Speakers & Docks › Portable Bluetooth Speakers",
       "Bluetooth Speaker", "bluetooth speaker",
       "water resistant | long battery life | deep bass | built in microphone | easy to carry",
       options=[("color", ["black", "blue", "red", "teal"])], price=(18.0, 150.0)),
    # -- beauty
    _t(_B, "hair fragrance", "Beauty & Personal Care › Hair Care › Styling Products › Hair Perfumes",
       "Hair Fragrance Mist", "hair fragrance mist",
       "alcohol free | long lasting | paraben free | cruelty free | travel size",
       options=[("scent", ["island vanilla", "coconut breeze", "sweet pea", "sandalwood"])], price=(8.0, 35.0)),
    _t(_B, "lip gloss", "Beauty & Personal Care › Makeup › Lips › Lip Glosses",
       "Lip Gloss", "lip gloss",
       "long lasting | paraben free | moisturizing formula | cruelty free | non sticky",
       options=[("color", ["clear", "pink", "red", "nude", "coral"])], price=(5.0, 30.0)),
    _t(_B, "toothpaste", "Beauty & Personal Care › Oral Care › Toothpaste",
       "Toothpaste", "toothpaste",
       "fresh breath | teeth whitening | fluoride free | sensitive teeth | natural ingredients",
       options=[("flavor", ["mint", "cinnamon", "charcoal", "strawberry"]), ("size", ["single tube", "two pack", "three pack"])],
       price=(4.0, 25.0)),
    _t(_B, "hair bun extension", "Beauty & Personal Care › Hair Care › Hair Extensions, Wigs & Accessories › Hair Extensions",
       "Messy Hair Bun Extension", "hair bun extension",
       "natural looking | heat resistant | easy to wear | synthetic fiber",
       options=[("color", ["natural black", "dark brown", "honey blonde", "auburn"])], price=(6.0, 25.0)),
    _t(_B, "face moisturizer", "Beauty & Personal Care › Skin Care › Face › Creams & Moisturizers",
       "Face Moisturizer", "face moisturizer",
       "fragrance free | hyaluronic acid | non greasy | dry skin | oil free",
       options=[("size", ["travel size", "regular size", "jumbo size"])], price=(10.0, 60.0)),
    _t(_B, "tongue cleaner", "Beauty & Personal Care › Oral Care › Tongue Cleaners",
       "Tongue Cleaner", "tongue cleaner",
       "easy to clean | stainless steel | high quality | non slip handle",
       options=[("style", ["single", "twin pack", "family pack"])], price=(4.0, 20.0)),
    # -- fashion
    _t(_F, "men's lounge pants", "Clothing, Shoes & Jewelry › Men › Clothing › Sleep & Lounge › Sleep Bottoms",
       "Men's Lounge Pants", "lounge pants",
       "drawstring closure | elastic waist | machine wash | side pockets | relaxed fit",
       options=[("size", _LETTER_SIZES), ("color", ["black", "charcoal", "heather blue", "navy"])],
       price=(12.0, 40.0), plural=True),
    _t(_F, "women's flats", "Clothing, Shoes & Jewelry › Women › Shoes › Flats",
       "Women's Ballet Flats", "ballet flats",
       "rubber sole | ankle strap | memory foam | slip resistant | leather sole",
       options=[("size", ["6", "7", "8", "9", "10"]), ("color", ["black", "beige", "red", "silver"])],
       price=(15.0, 60.0), plural=True),
    _t(_F, "women's blouse", "Clothing, Shoes & Jewelry › Women › Clothing › Tops, Tees & Blouses › Blouses & Button-Down Shirts",
       "Women's Short Sleeve Blouse", "sleeve blouse",
       "v neck | loose fit | button down | lightweight fabric | machine wash",
       options=[("size", _LETTER_SIZES), ("color", ["white", "black", "hot pink", "sky blue", "wine red"])],
       price=(12.0, 40.0)),
    _t(_F, "fleece jacket", "Clothing, Shoes & Jewelry › Men › Clothing › Jackets & Coats › Lightweight Jackets",
       "Fleece Jacket", "fleece jacket",
       "full zip | warm lining | zipper pockets | stand collar | machine wash",
       options=[("size", _LETTER_SIZES), ("color", ["gray", "navy", "olive", "black"])], price=(20.0, 60.0)),
    _t(_F, "hoodie sweatshirt", "Clothing, Shoes & Jewelry › Men › Clothing › Fashion Hoodies & Sweatshirts",
       "Pullover Hoodie Sweatshirt", "hoodie sweatshirt",
       "long sleeve | kangaroo pocket | soft fleece | drawstring hood | machine wash",
       options=[("size", _LETTER_SIZES), ("color", ["black", "gray", "burgundy", "forest green"])], price=(15.0, 50.0)),
    _t(_F, "women's running shorts", "Clothing, Shoes & Jewelry › Women › Clothing › Active › Active Shorts",
       "Women's Running Shorts", "running shorts",
       "quick dry | elastic waist | built in liner | side pockets | high waisted",
       options=[("size", _LETTER_SIZES), ("color", ["black", "coral", "navy", "white"])],
       price=(10.0, 35.0), plural=True),
    # -- food
    _t(_G, "coffee creamer", "Grocery & Gourmet Food › Beverages › Coffee, Tea & Cocoa › Coffee Creamers",
       "Coffee Creamer", "coffee creamer",
       "gluten free | non dairy | sugar free | keto friendly | lactose free",
       options=[("flavor", ["french vanilla", "hazelnut", "caramel", "original"]), ("size", ["single bottle", "multipack"])],
       price=(5.0, 45.0)),
    _t(_G, "popcorn seasoning", "Grocery & Gourmet Food › Pantry Staples › Herbs, Spices & Seasonings › Popcorn Seasoning",
       "Popcorn Seasoning", "popcorn seasoning",
       "low sodium | gluten free | kosher certified | non gmo",
       options=[("flavor", ["butter", "white cheddar", "kettle corn", "frosted sugar cookie"])], price=(5.0, 30.0)),
    _t(_G, "banana chips", "Grocery & Gourmet Food › Snack Foods › Chips & Crisps › Fruit Chips",
       "Freeze Dried Banana Chips", "banana chips",
       "gluten free | no sugar added | non gmo | vegan friendly | resealable bag",
       options=[("flavor", ["original", "apple cinnamon", "honey glazed"]), ("size", ["snack pack", "family size", "bulk box"])],
       price=(6.0, 40.0), plural=True),
    _t(_G, "pancake syrup", "Grocery & Gourmet Food › Breakfast Foods › Syrups",
       "Pancake Syrup", "pancake syrup",
       "sugar free | keto friendly | gluten free | all natural | low calorie",
       options=[("flavor", ["maple", "macadamia nut", "butter pecan", "blueberry"])], price=(6.0, 40.0)),
    _t(_G, "sea salt", "Grocery & Gourmet Food › Pantry Staples › Herbs, Spices & Seasonings › Salt & Salt Substitutes",
       "Sea Salt", "sea salt",
       "kosher certified | non gmo | fine grain | no additives | resealable bag",
       options=[("size", ["small jar", "large bag", "bulk bucket"])], price=(4.0, 30.0)),
    _t(_G, "trail mix", "Grocery & Gourmet Food › Snack Foods › Nuts, Seeds & Trail Mix › Trail Mix",
       "Trail Mix", "trail mix",
       "gluten free | low sodium | high protein | non gmo | resealable bag",
       options=[("flavor", ["antioxidant blend", "energy boost", "tropical fruit", "dark chocolate"])], price=(7.0, 40.0)),
    # -- furniture
    _t(_H, "dining table", "Home & Kitchen › Furniture › Kitchen & Dining Room Furniture › Tables",
       "Wooden Dining Table", "dining table",
       "easy to assemble | solid wood | space saving | water resistant | mid century",
       options=[("color", ["honey pine", "espresso", "white", "walnut"])], price=(90.0, 380.0)),
    _t(_H, "window curtains", "Home & Kitchen › Home Décor › Window Treatments › Curtains & Drapes",
       "Window Curtains", "window curtains",
       "blackout lining | thermal insulated | machine washable | grommet top | noise reducing",
       options=[("size", ['52" x 63"', '52" x 84"', '108" x 90"']), ("color", ["blue", "burnt orange", "grey", "sage green"])],
       price=(15.0, 70.0), plural=True),
    _t(_H, "bookshelf", "Home & Kitchen › Furniture › Home Office Furniture › Bookcases",
       "Bookshelf", "bookshelf",
       "easy to assemble | 5 tier | industrial style | metal frame | space saving",
       options=[("color", ["rustic brown", "black", "white oak"])], price=(40.0, 200.0)),
    _t(_H, "comforter set", "Home & Kitchen › Bedding › Comforters & Sets › Comforter Sets",
       "Comforter Set", "comforter set",
       "machine washable | all season | soft microfiber | hypoallergenic fill",
       options=[("size", ["twin", "full", "queen", "king"]), ("color", ["gray", "navy", "white", "blush"])],
       price=(30.0, 120.0)),
    _t(_H, "office chair", "Home & Kitchen › Furniture › Home Office Furniture › Home Office Desk Chairs",
       "Office Chair", "office chair",
       "lumbar support | adjustable height | breathable mesh | swivel wheels | easy to assemble",
       options=[("color", ["black", "gray", "white"])], price=(60.0, 300.0)),
    _t(_H, "floor lamp", "Tools & Home Improvement › Lighting & Ceiling Fans › Lamps & Shades › Floor Lamps",
       "Floor Lamp", "floor lamp",
       "dimmable light | energy efficient | easy to assemble | remote control | modern design",
       options=[("color", ["black", "gold", "silver", "white"])], price=(30.0, 150.0)),
)
# fmt: on

CATEGORIES: tuple[str, ...] = tuple(dict.fromkeys(t.category for t in PRODUCT_TYPES))

# Bullet points every product of a category may carry besides its attributes' (no attribute
# phrase of any type occurs in them: a product's text names only its own attributes).
NEUTRAL_LINES: dict[str, tuple[str, ...]] = {
    _E: ("Backed by a 12 month warranty", "Works with most laptops, phones and tablets", "Ships in a recyclable box"),
    _B: ("Dermatologist tested", "Suitable for daily use", "Made in a certified facility"),
    _F: ("Imported", "Fits true to size; see the size chart", "Designed for comfort all day"),
    _G: ("Packed in a facility that also handles tree nuts", "Store in a cool place", "Great for sharing"),
    _H: ("Ships in one box", "Tools included", "Fits most rooms and styles"),
}
