"""Certificates: lp and directional margins, stability bounds, region counts,
and the bisection cross-check. docs/design.md, section "Data flow of certify".
"""
