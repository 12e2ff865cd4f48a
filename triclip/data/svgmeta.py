"""Title, description and keywords from an SVG's RDF metadata (Dublin Core, as Inkscape writes it).

The metadata looks like ``<metadata><rdf:RDF><cc:Work><dc:title>...</dc:title>
<dc:description>...</dc:description><dc:subject><rdf:Bag><rdf:li>keyword</rdf:li>...``.
Only the ``Work``'s own fields count (``dc:title`` also names the creator and the
publisher, inside ``cc:Agent``). Namespaces are matched by URI, not by prefix; a
field may hold plain text or an ``rdf:Alt``/``rdf:Bag``/``rdf:Seq`` of ``rdf:li``.
Files that are not well-formed XML (bad bytes for their declared encoding,
undeclared entities) fall back to a tolerant regular-expression reading. Missing
metadata gives empty fields, never an error.
"""

from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

RDF = "http://www.w3.org/1999/02/22-rdf-syntax-ns#"
DC = "http://purl.org/dc/elements/1.1/"
SVG = "http://www.w3.org/2000/svg"


@dataclass(frozen=True)
class SvgMeta:
    """The human-written text of one clip-art file; empty strings when absent."""

    title: str = ""  # dc:title of the Work
    description: str = ""  # dc:description of the Work
    keywords: list[str] = field(default_factory=list)  # dc:subject items, in order, without repeats

    def train_captions(self) -> list[str]:
        """Non-empty, distinct of: title, description, keywords joined by ``", "``."""
        candidates = [self.title, self.description, ", ".join(self.keywords)]
        return list(dict.fromkeys(c for c in candidates if c))

    def query_caption(self) -> str:
        """The caption used as a retrieval query: the title, else the description, else ``""``."""
        return self.title or self.description


def _clean(text: str) -> str:
    return " ".join(text.split())


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _items(element: ET.Element) -> list[str]:
    """The ``rdf:li`` texts under a field, or its own text when it has none."""
    items = [_clean("".join(li.itertext())) for li in element.iter(f"{{{RDF}}}li")]
    return items if items else [_clean("".join(element.itertext()))]


def _first(items: list[str]) -> str:
    """The first non-empty item (an ``rdf:Alt`` lists one text per language)."""
    return next((item for item in items if item), "")


def _split_keywords(items: list[str]) -> list[str]:
    """Keywords from ``rdf:li`` items, or from one comma/semicolon separated string."""
    if len(items) == 1:
        items = re.split(r"[,;]", items[0])
    return list(dict.fromkeys(k for k in (_clean(i) for i in items) if k))


def _from_tree(root: ET.Element) -> SvgMeta:
    work = next((e for e in root.iter() if _local(e.tag) == "Work"), None)
    holder = work if work is not None else next(root.iter(f"{{{RDF}}}RDF"), None)
    fields = {}
    if holder is not None:
        for child in holder:  # the Work's own fields only: not those of its cc:Agent children
            if child.tag.startswith(f"{{{DC}}}") and _local(child.tag) not in fields:
                fields[_local(child.tag)] = _items(child)
    title = _first(fields.get("title", []))
    if not title:  # no RDF title: the SVG's own <title> element, when there is one
        svg_title = root.find(f"{{{SVG}}}title")
        title = _clean("".join(svg_title.itertext())) if svg_title is not None else ""
    description = _first(fields.get("description", []))
    return SvgMeta(title, description, _split_keywords(fields.get("subject", [])))


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


_AGENT = re.compile(r"<(\w+:)?Agent\b.*?</(\w+:)?Agent>", re.S)
_TAG = re.compile(r"<[^>]+>")
_LI = re.compile(r"<(?:\w+:)?li\b[^>]*>(.*?)</(?:\w+:)?li>", re.S)


def _field_re(name: str) -> re.Pattern:
    return re.compile(rf"<(?:\w+:)?{name}\b[^>]*?(?:/>|>(.*?)</(?:\w+:)?{name}>)", re.S)


def _from_text(text: str) -> SvgMeta:
    """Regular-expression reading for files an XML parser rejects."""
    block = re.search(r"<(?:\w+:)?RDF\b.*?</(?:\w+:)?RDF>", text, re.S)
    body = _AGENT.sub("", block.group(0) if block else "")
    found = {}
    for name in ("title", "description", "subject"):
        match = _field_re(name).search(body)
        found[name] = (match.group(1) or "") if match else ""
    plain = {name: _clean(html.unescape(_TAG.sub(" ", value))) for name, value in found.items()}
    items = [html.unescape(_TAG.sub("", li)) for li in _LI.findall(found["subject"])]
    title = plain["title"] or _svg_title(text)
    return SvgMeta(title, plain["description"], _split_keywords(items or [plain["subject"]]))


def _svg_title(text: str) -> str:
    """The SVG's own ``<title>`` element (unprefixed, so never ``dc:title``)."""
    match = re.search(r"<title\b[^>]*>(.*?)</title>", text, re.S)
    return _clean(html.unescape(_TAG.sub(" ", match.group(1)))) if match else ""


def parse_svg_metadata(data: bytes) -> SvgMeta:
    """Parse the metadata of one SVG file's bytes; never raises for bad content."""
    try:
        return _from_tree(ET.fromstring(data))
    except ET.ParseError:
        return _from_text(_decode(data))


def read_svg_metadata(path: str) -> SvgMeta:
    """:func:`parse_svg_metadata` of a file (``OSError`` if it cannot be read)."""
    with open(path, "rb") as handle:
        return parse_svg_metadata(handle.read())
