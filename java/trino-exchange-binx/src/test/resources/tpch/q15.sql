WITH revenue0 AS (
  SELECT suppkey AS supplier_no, sum(extendedprice * (1 - discount)) AS total_revenue
  FROM lineitem
  WHERE shipdate >= DATE '1996-01-01' AND shipdate < DATE '1996-01-01' + INTERVAL '3' MONTH
  GROUP BY suppkey)
SELECT s.suppkey, s.name, s.address, s.phone, total_revenue
FROM supplier s, revenue0
WHERE s.suppkey = supplier_no AND total_revenue = (SELECT max(total_revenue) FROM revenue0)
ORDER BY s.suppkey
