SELECT c.name, c.custkey, o.orderkey, o.orderdate, o.totalprice, sum(l.quantity)
FROM customer c, orders o, lineitem l
WHERE o.orderkey IN (SELECT orderkey FROM lineitem GROUP BY orderkey HAVING sum(quantity) > 300)
  AND c.custkey = o.custkey AND o.orderkey = l.orderkey
GROUP BY c.name, c.custkey, o.orderkey, o.orderdate, o.totalprice
ORDER BY o.totalprice DESC, o.orderdate, o.orderkey
LIMIT 100
